"""Multi-domain perplexity, Paloma style: loss, perplexity and bits per byte per named domain.

A domain is a list of token files plus the raw UTF-8 byte count of the text they came from
(``olmax tokenize`` manifests record token counts, not text bytes, so the bytes are given):

- ``NAME=PATH[,PATH...]:BYTES`` on the command line; a PATH may be a token file, a folder or
  ``manifest.json`` written by ``olmax tokenize`` (expanded to its files), or a mix file.
  ``:BYTES`` may be left out when every manifest named records ``text_bytes``.
- a YAML/JSON file ``{NAME: {paths: [...], bytes: N}}`` (relative paths are taken from the
  file's folder).

Batches and loss are ``olmax.eval.heldout``'s (``DomainEvaluator`` is its evaluator with one set
of files per domain): fixed windows, so two checkpoints see identical batches, and the training
CE, so ``olmax eval domains`` and ``olmax eval loss`` agree on the same files.

Bits per byte: ``total nats / ln 2 / bytes_scored`` where
``bytes_scored = bytes * tokens_scored / tokens_total``: a scored token stands for the domain's
average bytes per token (``tokens_total`` counts every token in the files, EOS included).
When every token of the domain is scored this is exactly Paloma's ``nats / ln 2 / bytes``.

JSON keys (``olmax eval domains --json`` and ``DomainEvaluator.evaluate_detailed``)::

    {"domains": {NAME: {"loss", "perplexity", "bits_per_byte", "tokens_scored", "tokens_total",
                        "windows", "bytes", "bytes_scored", "files"}},
     "macro": {"loss", "perplexity", "bits_per_byte"},      # unweighted means over domains
     "micro": {"loss", "perplexity", "bits_per_byte"},      # pooled over all scored tokens
     "seq_len", "batch_size", "batches"}

In-loop metric names (``evaluate``): ``{prefix}/{NAME}/CE loss``, ``.../PPL``,
``.../bits per byte``, and the same under ``{prefix}/macro/``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from olmax.config import Config, ConfigError
from olmax.data.dataset import file_sizes
from olmax.eval.heldout import HeldoutEvaluator, safe_exp

RESERVED = ("macro", "micro")


@dataclass(frozen=True)
class Domain:
    name: str
    paths: tuple[str, ...]
    bytes: int          # raw UTF-8 bytes of the text the token files hold


def _check_name(name: str, where: str) -> str:
    if not name or "/" in name or name in RESERVED:
        raise ConfigError(f"{where}: domain name {name!r} must be non-empty, without '/', and not "
                          f"{' or '.join(RESERVED)}")
    return name


def _manifest_text_bytes(path: str) -> int | None:
    m = Path(path) / "manifest.json" if os.path.isdir(path) else Path(path)
    if m.suffix != ".json" or not m.is_file():
        return None
    try:
        manifest = json.loads(m.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    tb = manifest.get("text_bytes") if isinstance(manifest, dict) else None
    return int(tb) if isinstance(tb, (int, float)) else None


def _domain(name: str, paths: Sequence[str], nbytes: Any, where: str) -> Domain:
    _check_name(name, where)
    if not paths:
        raise ConfigError(f"{where}: domain {name!r} has no token files")
    if nbytes is None:
        found = [_manifest_text_bytes(p) for p in paths]
        if any(b is None for b in found):
            raise ConfigError(f"{where}: domain {name!r} needs the raw UTF-8 byte count of its text "
                              f"(write {name}=PATHS:BYTES, or bytes: N in a YAML file)")
        nbytes = sum(found)  # type: ignore[arg-type]
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ConfigError(f"{where}: domain {name!r}: bytes must be a positive integer, got {nbytes!r}")
    return Domain(name, tuple(str(p) for p in paths), nbytes)


def parse_domain(spec: str) -> list[Domain]:
    """One ``--domain`` argument: ``NAME=PATHS[:BYTES]`` or a YAML/JSON file of domains."""
    if "=" not in spec:
        if spec.endswith((".yaml", ".yml", ".json")):
            return load_domain_file(spec)
        raise ConfigError(f"--domain {spec!r}: expected NAME=PATH[,PATH...]:BYTES or a .yaml file")
    name, rest = spec.split("=", 1)
    nbytes: Any = None
    head, sep, tail = rest.rpartition(":")
    if sep and tail.replace("_", "").isdigit():
        rest, nbytes = head, int(tail)
    return [_domain(name.strip(), [p for p in rest.split(",") if p], nbytes, f"--domain {spec!r}")]


def load_domain_file(path: str | os.PathLike) -> list[Domain]:
    """``{NAME: {paths: [...], bytes: N}}`` from YAML or JSON; relative paths from the file's folder."""
    import yaml
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"domain file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"--domain {p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({e})") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{p}: expected a mapping {{name: {{paths: [...], bytes: N}}}}")
    out = []
    for name, d in data.items():
        if not isinstance(d, dict) or not isinstance(d.get("paths"), (list, str)):
            raise ConfigError(f"{p}: domain {name!r} needs 'paths' (a list) and 'bytes'")
        extra = set(d) - {"paths", "bytes"}
        if extra:
            raise ConfigError(f"{p}: domain {name!r} has unknown keys {sorted(extra)} (allowed: paths, bytes)")
        paths = [d["paths"]] if isinstance(d["paths"], str) else d["paths"]
        paths = [str(x) if os.path.isabs(str(x)) else str(p.parent / str(x)) for x in paths]
        out.append(_domain(str(name), paths, d.get("bytes"), str(p)))
    return out


def load_domains(specs: Sequence[str]) -> list[Domain]:
    out: list[Domain] = []
    for s in specs:
        out += parse_domain(s)
    names = [d.name for d in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"domain names must be unique; repeated: {', '.join(dup)}")
    if not out:
        raise ConfigError("no domains given (--domain NAME=PATHS:BYTES)")
    return out


def domain_metrics(nats: float, tokens_scored: int, tokens_total: int, nbytes: int) -> dict[str, float]:
    """Loss, perplexity and bits per byte from summed nats (the formula in the module docstring)."""
    loss = nats / tokens_scored
    bytes_scored = nbytes * tokens_scored / tokens_total
    return {"loss": loss, "perplexity": safe_exp(loss), "bits_per_byte": nats / math.log(2) / bytes_scored,
            "bytes_scored": bytes_scored}


class DomainEvaluator(HeldoutEvaluator):
    """The held-out evaluator with one set of files per domain, reported per domain (and macro,
    micro) with bits per byte; ``batches=0`` scores every whole batch."""

    def __init__(self, cfg: Config, domains: Sequence[Domain], *, mesh: jax.sharding.Mesh | None = None,
                 prefix: str = "eval/domains", **windows: Any):
        super().__init__(cfg, mesh, prefix=prefix, sets={d.name: d.paths for d in domains}, **windows)
        itemsize = np.dtype(self.dtype).itemsize
        self.domains = [(d, sum(s // itemsize for s in file_sizes(self.files[d.name]))) for d in domains]

    def evaluate_detailed(self, params: Any) -> dict[str, Any]:
        sums = self.batch_sums(params)
        out: dict[str, Any] = {}
        pooled_nats = pooled_tokens = pooled_bytes = 0.0
        for d, tokens_total in self.domains:
            nats, scored = (sum(x) for x in zip(*sums[d.name]))
            m = domain_metrics(nats, int(scored), tokens_total, d.bytes)
            out[d.name] = {"loss": m["loss"], "perplexity": m["perplexity"], "bits_per_byte": m["bits_per_byte"],
                           "tokens_scored": int(scored), "tokens_total": int(tokens_total),
                           "windows": int(self.batches[d.name].shape[0] * self.batch_size), "bytes": d.bytes,
                           "bytes_scored": m["bytes_scored"], "files": self.files[d.name]}
            pooled_nats += nats
            pooled_tokens += scored
            pooled_bytes += m["bytes_scored"]
        keys = ("loss", "perplexity", "bits_per_byte")
        macro = {k: float(np.mean([r[k] for r in out.values()])) for k in keys}
        micro = domain_metrics(pooled_nats, pooled_tokens, pooled_tokens, pooled_bytes)  # type: ignore[arg-type]
        return {"domains": out, "macro": macro, "micro": {k: micro[k] for k in keys}, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "batches": self.max_batches or None}

    def evaluate(self, params: Any) -> dict[str, float]:
        """Flat metric names for the metrics logger."""
        r = self.evaluate_detailed(params)
        out = {}
        for name, m in [*r["domains"].items(), ("macro", r["macro"])]:
            out[f"{self.prefix}/{name}/CE loss"] = m["loss"]
            out[f"{self.prefix}/{name}/PPL"] = m["perplexity"]
            out[f"{self.prefix}/{name}/bits per byte"] = m["bits_per_byte"]
        return out
