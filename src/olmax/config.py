"""Typed, frozen configuration tree with strict overrides.

A recipe (``olmax.recipes``) returns a :class:`Config`. Users change it with
``--set section.field=value``; every key and every value is checked against the
dataclass fields before anything is built, and a mistake names the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration problem, with a message that names the field."""


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class RopeScaling:
    """YaRN scaling of RoPE, applied to full-attention layers only (as HF runs OLMo 3)."""

    rope_type: Literal["yarn"] = "yarn"
    factor: float = 8.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # None: derived as 0.1 * ln(factor) + 1 (HF's default); OLMo 3 long-context files set it.
    attention_factor: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 100278
    # Rows of the embedding and LM head; OLMo-core pads to a multiple of 128. Padded rows are
    # never a target. None means no padding (== vocab_size).
    padded_vocab_size: int | None = 100352
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    mlp_hidden: int = 11008
    norm_eps: float = 1e-6
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    # Sliding-window attention: query i sees keys i-W+1..i. Layer i is full attention iff
    # i % full_attention_every == full_attention_every - 1 (OLMo 3: every 4th layer).
    sliding_window: int | None = 4096
    full_attention_every: int = 4
    # OLMo-core's olmo3 builders also force the last layer to full attention
    # (force_full_attention_on_last_layer); it only matters when n_layers % 4 != 0.
    full_attention_last_layer: bool = True
    max_position_embeddings: int = 65536
    init_std: float = 0.02
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    # Attention kernel (olmax.model.dispatch picks per platform for "auto"): splash (Pallas
    # flash attention on TPU, skips blocks outside the sliding window), cudnn (flash attention
    # on GPU), xla (jax.nn.dot_product_attention's XLA path), cpu (olmax's C++ kernel, forward
    # and backward: CPU, fp32, heads a multiple of 16 wide; elsewhere blocked), blocked (the
    # reference's arithmetic per block of queries over the keys they can see, in XLA: CPU),
    # reference (exact einsum that materialises [t, s] scores: tests, short sequences).
    attention_impl: Literal["auto", "reference", "blocked", "cpu", "splash", "cudnn", "xla"] = "auto"
    # Training and evaluation on a CPU through olmax's C++ kernels (attention, SwiGLU and the q/k/v
    # split, norms and RoPE; "auto" attention becomes cpu): faster, but measured less faithful to
    # OLMo-core than XLA's arithmetic (the noise-floor verdict over 10 seeds, 8 vs 9 passes; DPO
    # against TRL 1.7e-5 vs 1.8e-6 in grad norm), so off by default. Decoding keeps its kernels
    # either way, and so does RL's training forward, which repeats the decode steps' arithmetic.
    cpu_training_kernels: bool = False
    # Splash attention tile sizes (query block, key/value block), forward and backward. 1024: on a
    # TPU v5e (2026-12-08) the 7B-width step ran 1.5% faster than with 512 at 4,096 tokens a
    # sequence, 1.2% at the d2048 shape; 2048 does not fit the kernels' scoped VMEM there.
    attention_block_q: int = 1024
    attention_block_kv: int = 1024
    # Rematerialisation per layer (olmax.model.olmo3.remat_policy): none; full (keep only the
    # layer input); minimal (keep every matmul output); save_attn_out (keep the attention
    # kernel's output, recompute the rest); save_proj (keep q/k/v, attention output and the
    # projection outputs); save_proj_except_out (save_proj less the two output projections'
    # outputs, attention's o and the MLP's down, which run again); offload_proj (save_proj's
    # tensors, offloaded to host memory: TPU/GPU).
    remat: Literal["none", "full", "minimal", "save_attn_out", "save_proj", "save_proj_except_out",
                   "offload_proj"] = "none"
    # Run the layers under jax.lax.scan over groups of ``full_attention_every`` layers (3 sliding
    # + 1 full for OLMo 3), so the program and its compile time do not grow with depth. The
    # parameter tree and every file format keep one entry per layer either way.
    scan_layers: bool = True
    # The loss computes logits for this many positions at a time (recomputed in the backward
    # pass), never the whole [batch, seq, vocab] fp32 array; None = all positions at once.
    logits_chunk: int | None = 1024

    @property
    def embedding_rows(self) -> int:
        return self.padded_vocab_size or self.vocab_size

    def is_full_attention(self, layer: int) -> bool:
        if self.sliding_window is None:
            return True
        k = self.full_attention_every
        return layer % k == k - 1 or (self.full_attention_last_layer and layer == self.n_layers - 1)

    def layer_window(self, layer: int) -> int | None:
        return None if self.is_full_attention(layer) else self.sliding_window


TokenDtype = Literal["uint8", "uint16", "uint32", "uint64"]   # token ids on disk (what `olmax tokenize` writes)


@dataclass(frozen=True)
class DataConfig:
    # Token files (raw little-endian arrays, no header) or OLMo-core mix files (``label,path`` lines).
    paths: tuple[str, ...] = ()
    # Substituted for ``{root}`` in mix-file lines (and the base of their relative paths).
    mix_root: str | None = None
    # Substituted for ``{TOKENIZER}`` in AI2's mix files (OLMo-core writes dolma2-tokenizer).
    mix_tokenizer: str | None = None
    sequence_length: int = 8192
    seed: int = 34521
    dtype: TokenDtype = "uint32"
    eos_token_id: int = 100257
    pad_token_id: int = 100277
    bos_token_id: int | None = None
    # Loader worker processes (0 = read in the main process).
    workers: int = 4
    prefetch: int = 2
    # OLMo-core's periodic-sequence filter: an instance with a pattern of period
    # min..max that repeats >= max_count times keeps its tokens but has every label ignored.
    repetition_filter: bool = False
    repetition_min_period: int = 1
    repetition_max_period: int = 13
    repetition_max_count: int = 32
    # Document masking (OLMo-core's ``generate_doc_lengths``): documents end at EOS, attention stays
    # within a document and RoPE positions restart in each; the loss is unchanged. AI2's pre-training
    # scripts don't set it.
    document_masking: bool = False
    # Label-mask files (raw bool, one byte per token, ``labels_mask_*.npy`` as open-instruct's SFT
    # converter writes them), one per token file of ``paths`` and in the same order (globs allowed):
    # a position counts in the loss only where its label's mask is True. Empty: every label counts.
    label_mask_paths: tuple[str, ...] = ()
    # How instances are cut from documents: none = the token files cut into L-token windows
    # (pre-training, OLMo-core ``NumpyFSLDataset``); obfd = EOS-delimited documents bin-packed per file
    # by best-fit decreasing and padded to L (SFT, OLMo-core ``NumpyPackedFSLDataset``).
    packing: Literal["none", "obfd"] = "none"
    # packing=obfd: a document longer than L is cut to its first L tokens (truncate) or into L-token
    # pieces (fragment), OLMo-core's ``LongDocStrategy``.
    long_doc_strategy: Literal["truncate", "fragment"] = "truncate"
    # Where the cached global order is written (default: beside the run directory).
    cache_dir: str | None = None
    # train.objective=dpo: a preference-pair folder (``pairs_token_ids.npy``, ``pairs_labels_mask.npy``,
    # ``pairs_index.npy``, ``manifest.json``; ``olmax tokenize --chat`` writes it). Used instead of ``paths``.
    preference_path: str | None = None
    # Optional local cache of remote (s3://, gs://, http(s)://) token files, in 16 MiB blocks
    # fetched on first use; None reads every instance with a range request.
    remote_cache_dir: str | None = None
    # Also hash sampled byte ranges of every token file (whole files up to 1 MiB) into the data
    # state, so a file edited in place with the same size is caught on resume (the fingerprint,
    # like OLMo-core's, hashes names and sizes only).
    content_fingerprint: bool = True


@dataclass(frozen=True)
class ScheduleConfig:
    # cosine: OLMo-core CosWithWarmup; half_cosine: HalfCosWithWarmup; linear: LinearWithWarmup;
    # two_part_cosine: stage 1 as AI2 ran it (CosWithWarmup, then HalfCosWithWarmup from
    # ``switch_step``); constant; hf_linear: HF's get_scheduler("linear") as open-instruct and TRL
    # step it (0-based: the first update has lr 0 when warmup > 0; decays to 0, alpha_f unused).
    name: Literal["cosine", "half_cosine", "linear", "two_part_cosine", "constant", "hf_linear"] = "cosine"
    warmup: int = 2000
    # Warmup as a fraction of the schedule's horizon instead: round(t_max * fraction) steps
    # (OLMo-core's ``warmup_fraction``; AI2's SFT uses 0.03 of the whole run). Replaces warmup.
    warmup_fraction: float | None = None
    # Steps the (first) schedule is defined over; None means train.steps.
    t_max: int | None = None
    alpha_f: float = 0.1
    # two_part_cosine only: the step where part 2 starts and part 2's horizon.
    switch_step: int | None = None
    t_max_2: int | None = None
    # two_part_cosine only: HalfCosWithWarmup's "warmup" in part 2; None = switch_step (continuous
    # with part 1). Set it apart from switch_step to replay a resume from an earlier checkpoint.
    part2_warmup: int | None = None


@dataclass(frozen=True)
class SkipStepConfig:
    enabled: bool = True
    sigma_factor: float = 6.0
    window: int = 128
    min_history: int = 64
    # A non-finite CE loss or grad norm always skips its update (from step 1, whatever
    # min_history says) and stays out of the history, so one bad batch cannot skip the next
    # ``window`` updates. True replays OLMo-core 3.0.0 exactly instead: the value enters the
    # history (every later test compares with a NaN mean: skipped until it leaves the window) and
    # before min_history a non-finite update is applied.
    olmo_core_nonfinite: bool = False
    # The run stops (exit status 2, no checkpoint of the bad state) after this many consecutive
    # updates skipped for a non-finite loss or grad norm.
    max_nonfinite_steps: int = 5


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # OLMo 3 decays every parameter except the token embedding.
    decay_embeddings: bool = False
    max_grad_norm: float | None = 1.0
    z_loss: float | None = 1e-5
    # Adam moments are always fp32 (bf16 moments added +0.93 loss in the published run).
    moments_dtype: Literal["float32", "bfloat16"] = "float32"
    skip_step: SkipStepConfig = field(default_factory=SkipStepConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass(frozen=True)
class MeshConfig:
    # Device mesh axes; -1 means "all remaining devices". Product must equal the global count.
    # ``slice``: data parallelism across TPU slices (over DCN); the others within a slice.
    slice: int = 1
    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    # With fsdp=-1 (and tensor=1): at most this many FSDP shards; the rest of the devices go to
    # tensor parallelism. For a global batch smaller than the slice (SFT: 32 instances of 32K
    # tokens on 64 or 256 chips), so one recipe runs on any slice. None: no cap.
    fsdp_max: int | None = None


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    # Global batch in instances (sequences), fixed whatever the device count.
    global_batch_size: int = 512
    # Instances per device per micro-batch; None = whole per-device share at once.
    micro_batch_size: int | None = None
    # Instead of a fixed micro-batch: the largest micro-batch a device may run. The plan takes the
    # largest divisor of the per-device batch that is no larger, so one recipe fits any slice
    # size (the 7B: 8 per device on v5p-128 -> 2 x 4; 2 per device on v6e-256 -> 1 x 2).
    max_micro_batch_size: int | None = None
    seed: int = 0
    log_interval: int = 1
    # Warm start: "hf:DIR" (HF weights), "olmax:PATH" (olmax weights) or "state:PATH" (weights and
    # Adam moments of a checkpoint, step reset: stage 2 from stage 1).
    init_from: str | None = None
    # Append each process's global instance ids per step to RUN_DIR/instance_ids.p<r>.jsonl
    # (audits of what every process actually read).
    trace_instance_ids: bool = False
    # Train this many epochs instead of train.steps: at the start of the run, train.steps becomes
    # epochs x the whole global batches in one epoch of the dataset (OLMo-core's
    # ``Duration.epochs``; AI2's SFT runs 2). The resolved count is what the run directory records.
    epochs: int | None = None
    # Loss normalisation over the global batch. 1: CE summed over every counted label of the batch,
    # divided by their number (the exact global token mean; does not depend on the topology).
    # R > 1: OLMo-core's SFT rule with R data-parallel ranks: rank r holds columns r::R of the global
    # batch (the split of ``olmax.data.order``); each rank's CE sum is divided by its own label count
    # and the R quotients are averaged (a rank with no counted label adds 0: OLMo-core divides by
    # zero). The two agree when every rank counts as many labels, as in pre-training.
    loss_ranks: int = 1
    # What a step optimises: lm (next-token CE over data.paths), dpo (preference pairs from
    # data.preference_path, the ``dpo`` section; global_batch_size then counts pairs) or grpo (RL
    # with verifiable rewards on completions sampled from the policy, the ``rl`` section;
    # global_batch_size then counts the completions of one step: rl.prompts_per_step x rl.group_size).
    objective: Literal["lm", "dpo", "grpo"] = "lm"


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 1000
    keep_last: int = 3
    keep_every: int | None = None
    async_save: bool = True
    # Write a CRC32 of every file of a checkpoint (each process its own files) and verify it on
    # restore; a mismatching checkpoint is skipped for the previous complete one. Off for speed.
    checksums: bool = True


@dataclass(frozen=True)
class EvalConfig:
    # Held-out token files (never part of the training index).
    heldout_paths: tuple[str, ...] = ()
    # Label-mask files of the held-out token files (as data.label_mask_paths): only their True
    # labels are scored (SFT: the assistant tokens). With data.packing=obfd the held-out documents
    # are packed as the training ones are.
    heldout_label_mask_paths: tuple[str, ...] = ()
    interval: int = 10000
    batches: int = 8
    batch_size: int = 8
    # A reference run (run dir, metrics.jsonl, TSV or W&B CSV) for the in-loop memorisation alarm:
    # training loss improving on the reference while held-out loss does not.
    reference: str | None = None


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging of the rows of metrics.jsonl (``olmax.metrics.sinks.WandbSink``),
    from process 0, as OLMo-core, open-instruct and TRL log. Off unless ``project`` is set."""

    project: str | None = None
    entity: str | None = None
    # None: the run directory's name.
    name: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()
    # auto: online when an API key is configured (WANDB_API_KEY or `wandb login`'s netrc entry) or
    # WANDB_MODE says so, else offline (files under RUN/wandb for `wandb sync`).
    mode: Literal["auto", "online", "offline"] = "auto"


@dataclass(frozen=True)
class DpoConfig:
    """Direct preference optimisation (``olmax.objectives.dpo``), as open-instruct's ``dpo_tune_cache.py``."""

    # dpo_norm: per-sequence log-prob = mean over the response tokens (open-instruct ``dpo_norm``,
    # TRL ``sigmoid_norm``); dpo: their sum (the original DPO).
    loss: Literal["dpo_norm", "dpo"] = "dpo_norm"
    beta: float = 5.0
    # Conservative DPO: -(1 - e) log sigmoid(beta x) - e log sigmoid(-beta x); 0 = plain DPO.
    label_smoothing: float = 0.0
    # The frozen reference model: "init" (the policy's initial weights) or a checkpoint
    # (hf:DIR, olmax:PATH, a run or weights directory). Its log-probs are computed once, before
    # the first step, into RUN_DIR/reference_logps/ (resumable, fingerprinted).
    reference: str = "init"
    # Pairs per forward pass of that first pass; None = one micro-batch's worth of pairs.
    reference_batch_size: int | None = None


@dataclass(frozen=True)
class RlConfig:
    """RL with verifiable rewards (``train.objective=grpo``; ``olmax.rl``), as open-instruct's
    ``grpo_fast.py`` ran it for OLMo 3. Each step samples ``group_size`` completions of
    ``prompts_per_step`` prompts from the policy being trained (its own weights, no copy), scores
    them, and takes ``num_mini_batches x num_epochs`` optimizer steps on them."""

    # JSONL: one prompt a line, {"messages": [...]} (rendered with the tokenizer's chat template and
    # its generation prompt) or {"prompt": "..."} (raw text), and "ground_truth" (the gold answer).
    prompts_path: str | None = None
    # tokenizer.json (or a folder holding one); None = the one of train.init_from (or of the data).
    tokenizer: str | None = None
    group_size: int = 8
    prompts_per_step: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    # Longer prompts are left out (counted at start-up), as open-instruct does.
    max_prompt_length: int = 2048
    max_response_length: int = 32768
    # Generation also stops after any of these strings (open-instruct --stop_strings).
    stop_strings: tuple[str, ...] = ()
    # A built-in (math, exact_match, format) or module:function; reward = multiplier x score.
    reward: str = "math"
    reward_multiplier: float = 10.0
    reward_timeout_s: float = 10.0
    # centered: r - group mean (AI2's OLMo 3 runs); standard: / (population std + 1e-8);
    # trl_group / trl_batch: TRL's scale_rewards="group" / "batch" (olmax.rl.grpo).
    advantage: Literal["centered", "standard", "trl_group", "trl_batch"] = "centered"
    clip_low: float = 0.2
    clip_high: float = 0.272
    # k3 KL to the policy's initial weights (a frozen second copy, only when > 0).
    kl_beta: float = 0.0
    # token_mean (global token mean; open-instruct after PR #1161, TRL dapo), sequence_mean (TRL
    # grpo), microbatch_mean (per micro-batch mean / accumulation steps: AI2's 7B runs).
    aggregation: Literal["token_mean", "sequence_mean", "microbatch_mean"] = "token_mean"
    # Groups whose rewards are all equal carry no signal and are not trained on.
    filter_zero_std: bool = True
    # Keep sampling new prompts until prompts_per_step informative groups (at most
    # max_sampling_rounds rounds of prompts_per_step prompts a step).
    active_sampling: bool = False
    max_sampling_rounds: int = 4
    # Prompts whose group solved at least this share (reward > 0) are not drawn again; None = off.
    retire_pass_rate: float | None = None
    num_mini_batches: int = 1
    num_epochs: int = 1
    # Truncated importance sampling cap against the generation log-probs; None = off. In olmax
    # they are the trainer's own: the weight is exactly 1 on the CPU, 1 up to rounding elsewhere.
    tis_cap: float | None = 2.0
    # Completions that hit max_response_length train nothing (open-instruct mask_truncated_completions).
    mask_truncated: bool = False
    # Completions decoded at once (the engine's row slots); None = all rows of a sampling round.
    generation_batch: int | None = None
    # continuous: a finished completion's slot takes the next waiting row at once, several decode
    # steps per host round trip; static: each batch decodes until its longest row stops. The same
    # completions either way (olmax.engine).
    batching: str = "continuous"
    # The continuous engine's KV cache: contiguous (every slot holds prompt + response positions) or
    # paged (pages of page_size positions as rows grow, a group's prompt stored once; the same
    # completions, olmax.engine.paged). kv_budget: its bytes, "512MiB" / "2GiB" / MiB, or a fraction
    # of free device memory in (0, 1]; None = what the contiguous cache of generation_batch rows holds.
    kv_cache: str = "contiguous"
    page_size: int = 16
    kv_budget: str | None = None
    # Training rows of this many tokens, each packing several completions (with their prompts) as
    # documents (open-instruct --pack_length; olmax.rl.packing); None = one completion a row, padded
    # to data.sequence_length.
    pack_length: int | None = None


@dataclass(frozen=True)
class Config:
    name: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    rl: RlConfig = field(default_factory=RlConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        return _build(cls, d, "")

    @classmethod
    def from_yaml(cls, text: str, where: str = "config") -> Config:
        try:
            d = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a YAML mapping of config sections")
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    def override(self, assignments: list[str] | tuple[str, ...]) -> Config:
        """Apply ``key=value`` strings, strictly."""
        cfg = self
        for a in assignments:
            if "=" not in a:
                raise ConfigError(f"override {a!r} is not of the form key=value (e.g. train.steps=100)")
            key, raw = a.split("=", 1)
            cfg = set_value(cfg, key.strip(), raw.strip())
        return cfg


# --------------------------------------------------------------------------- model identity

# The highest sampling temperature olmax accepts (generate, chat, serve, RL rollouts): far above any
# useful one (past it the distribution is uniform to float precision), low enough to catch a typo (1e9).
MAX_TEMPERATURE = 100.0

# Model fields that say how the model is computed, not what its parameters are: they may differ
# between a checkpoint and the run that loads it (e.g. an elastic resume onto other accelerators
# with another attention kernel or remat policy).
RUNTIME_MODEL_FIELDS = frozenset({"compute_dtype", "attention_impl", "cpu_training_kernels", "attention_block_q",
                                  "attention_block_kv",
                                  "remat", "scan_layers", "logits_chunk", "init_std", "max_position_embeddings"})


def model_differences(a: ModelConfig, b: ModelConfig, ignore: frozenset[str] = frozenset()
                      ) -> list[tuple[str, Any, Any]]:
    """``(field, a's value, b's value)`` for every architecture field where ``a`` and ``b`` differ
    (``RUNTIME_MODEL_FIELDS`` and ``ignore`` excepted). The one test of "same model" used by
    resume, warm starts and parity."""
    skip = RUNTIME_MODEL_FIELDS | ignore

    def value(m: ModelConfig, name: str) -> Any:
        # padded_vocab_size None means "no padding": compare the embedding rows it stands for.
        return m.embedding_rows if name == "padded_vocab_size" else getattr(m, name)

    return [(f.name, value(a, f.name), value(b, f.name)) for f in dataclasses.fields(ModelConfig)
            if f.name not in skip and value(a, f.name) != value(b, f.name)]


# --------------------------------------------------------------------------- validation


def validate(cfg: Config) -> Config:
    """Cross-field checks that are cheap and catch mistakes before anything compiles."""
    _validate_ranges(cfg)  # first: the checks below divide by these sizes
    _validate_wandb(cfg.wandb)
    m = cfg.model
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})")
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim ({m.head_dim}) must be even for RoPE")
    if m.padded_vocab_size is not None and m.padded_vocab_size < m.vocab_size:
        raise ConfigError(
            f"model.padded_vocab_size ({m.padded_vocab_size}) is smaller than model.vocab_size ({m.vocab_size})")
    for name in ("attention_block_q", "attention_block_kv"):
        if getattr(m, name) <= 0 or getattr(m, name) % 128:
            raise ConfigError(f"model.{name} must be a positive multiple of 128, got {getattr(m, name)}")
    for name, tid in (("eos_token_id", cfg.data.eos_token_id), ("pad_token_id", cfg.data.pad_token_id),
                      ("bos_token_id", cfg.data.bos_token_id)):
        if tid is not None and not 0 <= tid < m.vocab_size:
            raise ConfigError(f"data.{name} ({tid}) is outside the vocabulary (model.vocab_size={m.vocab_size})")
    if cfg.optim.moments_dtype != "float32":
        raise ConfigError(
            "optim.moments_dtype must be float32: bf16 Adam moments added +0.93 loss within 1000 steps in "
            "the published OLMo 3 reproduction (the moments silently followed bf16 weights)")
    s = cfg.optim.schedule
    if s.name == "two_part_cosine" and (s.switch_step is None or s.t_max_2 is None):
        raise ConfigError("optim.schedule.two_part_cosine needs optim.schedule.switch_step and optim.schedule.t_max_2")
    t = cfg.train
    if t.micro_batch_size is not None and t.max_micro_batch_size is not None:
        raise ConfigError("set train.micro_batch_size or train.max_micro_batch_size, not both "
                          f"(got {t.micro_batch_size} and {t.max_micro_batch_size})")
    if t.global_batch_size % t.loss_ranks:
        raise ConfigError(f"train.loss_ranks ({t.loss_ranks}) must divide train.global_batch_size "
                          f"({t.global_batch_size}): each rank holds the same number of instances")
    if t.loss_ranks > 1 and cfg.data.repetition_filter:
        raise ConfigError("train.loss_ranks > 1 (OLMo-core's per-rank SFT loss) does not count the rows "
                          "data.repetition_filter masks as OLMo-core's pre-training does: use train.loss_ranks=1")
    if cfg.eval.heldout_label_mask_paths and not cfg.eval.heldout_paths:
        raise ConfigError("eval.heldout_label_mask_paths are the label masks of eval.heldout_paths, which is empty: "
                          "set both, or neither")
    if cfg.data.label_mask_paths and cfg.data.repetition_filter:
        raise ConfigError("data.repetition_filter masks whole instances and data.label_mask_paths masks labels: "
                          "use one (OLMo-core's SFT runs have no repetition filter)")
    # The dpo section is checked for every objective (nonsense is nonsense); data.preference_path is
    # checked when a DPO run opens it (recipes leave it unset).
    if not (math.isfinite(cfg.dpo.beta) and cfg.dpo.beta > 0):
        raise ConfigError(f"dpo.beta must be a finite number > 0, got {cfg.dpo.beta!r}")
    if not 0.0 <= cfg.dpo.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must be >= 0 and < 0.5, got {cfg.dpo.label_smoothing!r}")
    if cfg.dpo.reference_batch_size is not None and cfg.dpo.reference_batch_size < 1:
        raise ConfigError(f"dpo.reference_batch_size must be positive or null, got {cfg.dpo.reference_batch_size}")
    _validate_rl(cfg)
    return cfg


def parse_kv_budget(text: str | float | int | None) -> float | int | None:
    """A KV memory budget as given (``--kv-budget``): ``"512MiB"`` / ``"2GiB"`` / a plain number
    of MiB (bytes returned, an int), or a fraction of the device's free memory in (0, 1] (a float).
    None: no budget."""
    if text is None or isinstance(text, (int, float)) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip()
        units = {"kib": 2**10, "mib": 2**20, "gib": 2**30}
        for unit, scale in units.items():
            if s.lower().endswith(unit):
                try:
                    return int(float(s[:-len(unit)]) * scale)
                except ValueError:
                    break
        try:
            value = float(s) if "." in s else int(s) * 2**20
        except ValueError:
            raise ConfigError(f"kv budget {text!r} is neither a size (512MiB, 2GiB, a number of MiB) nor a "
                              "fraction of free device memory in (0, 1]") from None
        if isinstance(value, int):
            if value < 1:
                raise ConfigError(f"kv budget {text!r} must be at least 1 MiB")
            return value
    if value is None:
        return None
    if isinstance(value, float) and not 0 < value <= 1:
        raise ConfigError(f"kv budget {value} as a fraction of free device memory must be in (0, 1]")
    return value



def _validate_rl(cfg: Config) -> None:
    r = cfg.rl
    for name in ("group_size", "prompts_per_step", "max_prompt_length", "max_response_length", "max_sampling_rounds",
                 "num_mini_batches", "num_epochs"):
        if getattr(r, name) < 1:
            raise ConfigError(f"rl.{name} must be >= 1, got {getattr(r, name)}")
    if r.batching not in ("continuous", "static"):
        raise ConfigError(f"rl.batching must be 'continuous' or 'static', got {r.batching!r}")
    if r.kv_cache not in ("contiguous", "paged"):
        raise ConfigError(f"rl.kv_cache must be 'contiguous' or 'paged', got {r.kv_cache!r}")
    if r.kv_cache == "paged" and r.batching != "continuous":
        raise ConfigError("rl.kv_cache=paged pages the continuous engine's cache: set rl.batching=continuous")
    if r.page_size < 1 or r.page_size & (r.page_size - 1):
        raise ConfigError(f"rl.page_size must be a positive power of two (tokens per page), got {r.page_size}")
    if r.kv_budget is not None:
        try:
            parse_kv_budget(r.kv_budget)
        except ConfigError as e:
            raise ConfigError(f"rl.kv_budget: {e}") from None
    if r.generation_batch is not None and r.generation_batch < 1:
        raise ConfigError(f"rl.generation_batch must be >= 1 or null, got {r.generation_batch}")
    if r.pack_length is not None and r.pack_length < r.max_prompt_length + r.max_response_length:
        raise ConfigError(f"rl.pack_length ({r.pack_length}) must hold the longest prompt and completion: at least "
                          f"rl.max_prompt_length + rl.max_response_length = "
                          f"{r.max_prompt_length + r.max_response_length} tokens (or null: no packing)")
    if not 0 < r.temperature <= MAX_TEMPERATURE:
        raise ConfigError(f"rl.temperature must be > 0 (RL samples) and <= {MAX_TEMPERATURE:g}, got {r.temperature!r}")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rl.top_p must be in (0, 1], got {r.top_p!r}")
    if not (0 <= r.clip_low < 1 and r.clip_high >= 0):
        raise ConfigError(f"rl.clip_low must be in [0, 1) and rl.clip_high >= 0, got {r.clip_low!r}, {r.clip_high!r}")
    if r.kl_beta < 0:
        raise ConfigError(f"rl.kl_beta must be >= 0, got {r.kl_beta!r}")
    if r.tis_cap is not None and not r.tis_cap > 0:
        raise ConfigError(f"rl.tis_cap must be > 0 or null, got {r.tis_cap!r}")
    if not r.reward_multiplier > 0:
        # 0 makes every group's rewards equal (nothing to learn); a negative one trains the policy
        # away from what the verifier accepts.
        raise ConfigError(f"rl.reward_multiplier must be > 0, got {r.reward_multiplier!r}")
    if not r.reward_timeout_s > 0:
        raise ConfigError(f"rl.reward_timeout_s must be > 0, got {r.reward_timeout_s!r}")
    if r.retire_pass_rate is not None and not 0 < r.retire_pass_rate <= 1:
        raise ConfigError(f"rl.retire_pass_rate must be in (0, 1] or null, got {r.retire_pass_rate!r}")
    if any(not s for s in r.stop_strings):
        raise ConfigError("rl.stop_strings has an empty string")
    if cfg.train.objective != "grpo":
        return
    rows = r.prompts_per_step * r.group_size
    if cfg.train.global_batch_size != rows:
        raise ConfigError(f"train.objective=grpo: train.global_batch_size ({cfg.train.global_batch_size}) must be "
                          f"rl.prompts_per_step x rl.group_size = {r.prompts_per_step} x {r.group_size} = {rows} "
                          "(the completions of one step)")
    if rows % r.num_mini_batches or (rows // r.num_mini_batches) % r.group_size:
        raise ConfigError(f"rl.num_mini_batches ({r.num_mini_batches}) must split the step's {r.prompts_per_step} "
                          f"groups of {r.group_size} completions into whole groups")
    need = r.max_prompt_length + r.max_response_length
    if cfg.data.sequence_length < need:
        raise ConfigError(f"train.objective=grpo: data.sequence_length ({cfg.data.sequence_length}) must hold "
                          f"rl.max_prompt_length + rl.max_response_length = {need} tokens")
    if r.active_sampling and not r.filter_zero_std:
        raise ConfigError("rl.active_sampling refills the groups rl.filter_zero_std drops: set rl.filter_zero_std=true")


def _validate_wandb(w: WandbConfig) -> None:
    # W&B's own rules (wandb.Settings), checked before training rather than at its first log.
    for name in ("project", "entity"):
        v = getattr(w, name)
        bad = sorted({c for c in (v or "") if c in '/\\#?%:'})
        if bad or (v is not None and len(v) > 128):
            raise ConfigError(f"wandb.{name}={v!r}: W&B names are at most 128 characters, without any of "
                              f"/ \\ # ? % : (found {' '.join(map(repr, bad)) or 'too long'})")
    for t in w.tags:
        if not t.strip() or len(t) > 64:
            raise ConfigError(f"wandb.tags: each tag must be 1 to 64 characters, got {t!r}")
    if not w.project:
        extra = [f"wandb.{k}" for k in ("entity", "name", "group", "tags") if getattr(w, k)]
        extra += ["wandb.mode"] if w.mode != "auto" else []
        if extra:
            raise ConfigError(f"{', '.join(extra)} set but wandb.project is empty, so W&B logging is off: "
                              "set wandb.project=NAME to log to W&B")


def _validate_ranges(cfg: Config) -> None:
    """Values that are accepted by their type but mean nothing (or NaN) for training."""
    o, s, sk = cfg.optim, cfg.optim.schedule, cfg.optim.skip_step

    def number(name: str, v: float | None, lo: float = 0.0, *, strict: bool = False, hi: float | None = None,
               optional: bool = False) -> None:
        if v is None and optional:
            return
        ok = v is not None and math.isfinite(v) and (v > lo if strict else v >= lo) and (hi is None or v < hi)
        if not ok:
            rng = (f"> {lo:g}" if strict else f">= {lo:g}") + (f" and < {hi:g}" if hi is not None else "")
            raise ConfigError(f"{name} must be a finite number {rng}{' or null' if optional else ''}, got {v!r}")

    number("optim.lr", o.lr)
    number("optim.beta1", o.beta1, hi=1.0)
    number("optim.beta2", o.beta2, hi=1.0)
    number("optim.eps", o.eps, strict=True)
    number("optim.weight_decay", o.weight_decay)
    number("optim.max_grad_norm", o.max_grad_norm, strict=True, optional=True)
    number("optim.z_loss", o.z_loss, optional=True)
    number("optim.schedule.alpha_f", s.alpha_f)
    number("optim.schedule.warmup_fraction", s.warmup_fraction, optional=True)
    if s.warmup_fraction is not None and s.warmup_fraction > 1:
        raise ConfigError(f"optim.schedule.warmup_fraction must be between 0 and 1, got {s.warmup_fraction!r}")
    number("optim.skip_step.sigma_factor", sk.sigma_factor, strict=True)
    m, t = cfg.model, cfg.train
    number("model.norm_eps", m.norm_eps, strict=True)
    number("model.rope_theta", m.rope_theta, strict=True)
    number("model.init_std", m.init_std, strict=True)
    if m.rope_scaling is not None:
        r = m.rope_scaling
        number("model.rope_scaling.factor", r.factor, strict=True)
        number("model.rope_scaling.beta_fast", r.beta_fast, strict=True)
        number("model.rope_scaling.beta_slow", r.beta_slow, strict=True)
        number("model.rope_scaling.attention_factor", r.attention_factor, strict=True, optional=True)
    for where, v in _float_fields(cfg, ""):  # anything else: NaN and inf are never meant
        if not math.isfinite(v):
            raise ConfigError(f"{where} must be a finite number, got {v!r}")
    for axis in ("slice", "data", "fsdp", "tensor"):
        v = getattr(cfg.mesh, axis)
        if v == 0 or v < -1:
            raise ConfigError(f"mesh.{axis} must be positive or -1 (all remaining devices), got {v}")
    if cfg.mesh.fsdp_max is not None and cfg.mesh.fsdp_max < 1:
        raise ConfigError(f"mesh.fsdp_max must be positive or null, got {cfg.mesh.fsdp_max}")
    for name, seed in (("train.seed", t.seed), ("data.seed", cfg.data.seed)):
        if not 0 <= seed < 2**63:
            raise ConfigError(f"{name} must be an integer in 0..2**63-1, got {seed}")
    ints = {  # name: (value, lowest valid value, None allowed)
        "model.vocab_size": (m.vocab_size, 1, False), "model.d_model": (m.d_model, 1, False),
        "model.n_layers": (m.n_layers, 1, False), "model.n_heads": (m.n_heads, 1, False),
        "model.n_kv_heads": (m.n_kv_heads, 1, False), "model.head_dim": (m.head_dim, 1, False),
        "model.mlp_hidden": (m.mlp_hidden, 1, False), "model.sliding_window": (m.sliding_window, 1, True),
        "model.full_attention_every": (m.full_attention_every, 1, False),
        "model.logits_chunk": (m.logits_chunk, 1, True),
        "model.max_position_embeddings": (m.max_position_embeddings, 1, False),
        "model.rope_scaling.original_max_position_embeddings": (
            m.rope_scaling.original_max_position_embeddings if m.rope_scaling else None, 1, True),
        "data.sequence_length": (cfg.data.sequence_length, 1, False),
        "train.global_batch_size": (t.global_batch_size, 1, False), "train.steps": (t.steps, 1, False),
        "train.micro_batch_size": (t.micro_batch_size, 1, True),
        "train.max_micro_batch_size": (t.max_micro_batch_size, 1, True),
        "train.log_interval": (t.log_interval, 1, False), "train.epochs": (t.epochs, 1, True),
        "checkpoint.interval": (cfg.checkpoint.interval, 1, False),
        "optim.schedule.warmup": (s.warmup, 0, False),
        "optim.schedule.t_max": (s.t_max, 1, True), "optim.schedule.t_max_2": (s.t_max_2, 1, True),
        "optim.schedule.switch_step": (s.switch_step, 0, True),
        "optim.schedule.part2_warmup": (s.part2_warmup, 0, True),
        "optim.skip_step.window": (sk.window, 1, False), "optim.skip_step.min_history": (sk.min_history, 0, False),
        "optim.skip_step.max_nonfinite_steps": (sk.max_nonfinite_steps, 1, False),
        "data.workers": (cfg.data.workers, 0, False), "data.prefetch": (cfg.data.prefetch, 0, False),
        "data.repetition_min_period": (cfg.data.repetition_min_period, 1, False),
        "data.repetition_max_period": (cfg.data.repetition_max_period, 1, False),
        "data.repetition_max_count": (cfg.data.repetition_max_count, 1, False),
        "checkpoint.keep_last": (cfg.checkpoint.keep_last, 1, False),  # 0 would delete the newest checkpoint
        "checkpoint.keep_every": (cfg.checkpoint.keep_every, 1, True),
        "eval.interval": (cfg.eval.interval, 1, False), "eval.batches": (cfg.eval.batches, 1, False),
        "eval.batch_size": (cfg.eval.batch_size, 1, False), "train.loss_ranks": (t.loss_ranks, 1, False),
    }
    for name, (v, lo, optional) in ints.items():
        if v is None and optional:
            continue
        if v is None or v < lo:
            what = "positive" if lo == 1 else f">= {lo}"
            raise ConfigError(f"{name} must be {what}{' or null' if optional else ''}, got {v!r}")


def _float_fields(obj: Any, path: str):
    """``(dotted name, value)`` of every float-typed field of a config tree."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from _float_fields(v, f"{path}{f.name}.")
        elif isinstance(v, float):
            yield path + f.name, v


# --------------------------------------------------------------------------- machinery


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    return obj


def _unknown_key(path: str, key: Any, valid: list[str]) -> ConfigError:
    key = str(key)  # YAML keys may be numbers, booleans or null; config keys are names
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {(path + close[0])!r}?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"unknown config key {(path + key)!r}{hint}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Check/convert ``value`` (from YAML or a dict) to the field type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                with contextlib.suppress(ConfigError):  # try the next member of the union
                    return _coerce(a, value, where)
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, where + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected str, got {value!r}")
    raise ConfigError(f"{where}: unsupported field type {tp}")


def _build(cls: type, d: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in d.items():
        if k not in names:
            raise _unknown_key(path, k, names)
        kwargs[k] = _coerce(hints[k], v, path + k)
    return cls(**kwargs)


def _parse_scalar(raw: str) -> Any:
    """Parse a command-line value with YAML rules (1e-4, true, null, [a, b])."""
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw
    if isinstance(value, str):
        # YAML 1.1 reads "1e-4" (no dot) as a string; numbers are what users mean.
        for conv in (int, float):
            try:
                return conv(value)
            except ValueError:
                pass
    return value


def set_value(cfg: Any, dotted: str, raw: Any) -> Any:
    """Return a copy of ``cfg`` with the field at ``dotted`` set, checking key and type."""
    parts = dotted.split(".")
    return _set(cfg, parts, raw, "")


def _set(obj: Any, parts: list[str], raw: Any, path: str) -> Any:
    cls = type(obj)
    names = [f.name for f in dataclasses.fields(cls)]
    key = parts[0]
    if key not in names:
        raise _unknown_key(path, key, names)
    tp = typing.get_type_hints(cls)[key]
    where = path + key
    if len(parts) == 1:
        value = _parse_scalar(raw) if isinstance(raw, str) else raw
        # A string field must stay a string even when YAML would read "123" as a number.
        if isinstance(raw, str) and _accepts_str(tp) and not isinstance(value, (str, type(None))):
            value = raw
        str_tuple = typing.get_origin(tp) is tuple and typing.get_args(tp)[:1] == (str,)
        if isinstance(raw, str) and str_tuple and isinstance(value, str):  # a,b,c: a tuple of strings
            value = [v for v in value.split(",") if v]
        return dataclasses.replace(obj, **{key: _coerce(tp, value, where)})
    child = getattr(obj, key)
    if child is None:
        # Optional sub-section (e.g. model.rope_scaling): start from its defaults.
        sub = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if not sub:
            raise ConfigError(f"{where} is not a section; cannot set {where}.{parts[1]}")
        child = sub[0]()
    if not dataclasses.is_dataclass(child):
        raise ConfigError(f"{where} is a value, not a section; cannot set {where}.{'.'.join(parts[1:])}")
    return dataclasses.replace(obj, **{key: _set(child, parts[1:], raw, where + ".")})


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp)


def load_yaml(path: str) -> Config:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 YAML config (undecodable byte at offset {e.start})") from None
    return Config.from_yaml(text, where=path)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (the later one would win silently)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"duplicate key {key!r} at line {key_node.start_mark.line + 1} "
                                  f"(first at line {seen[key] + 1})")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)
