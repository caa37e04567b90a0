"""What a recipe runs with on one named TPU slice where a measurement chose it, in one table.

A recipe serves every slice, so its own settings are the ones that fit all of them (the 7B stage 1
rematerialises every layer: it fits a v6e chip's 31 GiB). Where ``olmax compile --sweep`` found a
faster choice that fits a slice with the headroom asked for, the table holds it, as the ``--set``
lines it takes, with the measurement behind it. ``olmax compile --topology`` and ``olmax launch
tpu`` know the slice and apply its entry before the user's ``--set`` lines (which win); ``olmax
train`` started by hand does not know its slice and runs the recipe as written.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SliceChoice:
    overrides: tuple[str, ...]   # config lines, as --set takes them
    why: str                     # the measurement that chose them, with its result file


CHOICES: dict[tuple[str, str], SliceChoice] = {
    ("olmo3_7b_stage1", "v5p-128"): SliceChoice(
        ("model.remat=save_proj", "train.max_micro_batch_size=2"),
        "olmax compile --sweep, 2026-12-06 (benchmarks/results/compile-sweep-stage1_tpu-aot_2026-12-06.md): "
        "save_proj in 4 micro-batches of 2 needs 64.07 GiB a chip (33% of the HBM free) for an estimated "
        "8.80 s a step with the splash kernel priced in (est. MFU 75.6%, recompute overhead 1.00x), full remat "
        "25.35 GiB for 10.91 s (60.9%); XLA alone 7.93 s against 9.75 s"),
    ("olmo3_7b_stage1", "v5p-256"): SliceChoice(
        ("model.remat=save_proj", "train.max_micro_batch_size=2"),
        "olmax compile --sweep, 2026-12-07 (benchmarks/results/compile-sweep-stage1-v5p256_tpu-aot_2026-12-07.md): "
        "save_proj in 2 micro-batches of 2 needs 62.54 GiB a chip (35% of the HBM free) for an estimated "
        "4.40 s a step with the splash kernel priced in (est. MFU 75.6%, recompute overhead 1.00x), full remat "
        "in one pass of 4 23.60 GiB for 5.45 s (60.9%); minimal is within 1% (4.44 s, 58.13 GiB)"),
    ("olmo3_7b_stage1", "v6e-256"): SliceChoice(
        ("model.remat=save_proj_except_out", "train.max_micro_batch_size=1"),
        "olmax compile --sweep, 2026-12-07 (benchmarks/results/compile-sweep-stage1-v6e_tpu-aot_2026-12-07.md): "
        "XLA gives a v6e step no time, so by compiled FLOPs: save_proj_except_out in 2 passes of 1 needs 27.37 GiB "
        "a chip (12% of the HBM free) for 1.09x the model's FLOPs with the splash kernel counted, save_attn_out "
        "19.07 GiB for 1.23x, full remat 11.66 GiB for 1.27x; save_proj does not fit one sequence (31.50 GiB)"),
    ("olmo3_7b_stage1", "tpu7x-128"): SliceChoice(
        ("model.remat=minimal", "train.max_micro_batch_size=2"),
        "olmax compile --sweep, 2026-12-07 (benchmarks/results/compile-sweep-stage1-ironwood_tpu-aot_2026-12-07.md): "
        "XLA gives an Ironwood 7B step no time, so by compiled FLOPs: minimal in 2 passes of 2 needs 71.20 GiB a "
        "device (25% of the HBM free) for 0.99x the model's FLOPs with the splash kernel counted, full remat in "
        "one pass of 4 41.54 GiB for 1.27x; save_proj is within 1% (1.00x, 72.98 GiB)"),
    ("olmo3_7b_stage2", "v5p-128"): SliceChoice(
        ("model.remat=save_proj", "train.max_micro_batch_size=2"),
        "olmax compile --sweep, 2026-12-07 (benchmarks/results/compile-sweep-stage2_tpu-aot_2026-12-07.md): "
        "save_proj in 2 micro-batches of 2 needs 64.07 GiB a chip (33% of the HBM free) for an estimated "
        "4.40 s a step with the splash kernel priced in (est. MFU 75.6%, recompute overhead 1.00x), full remat "
        "in one pass of 4 24.54 GiB for 5.45 s (61.0%); XLA alone 3.96 s against 4.87 s"),
    ("olmo3_7b_think_dpo", "v5p-128"): SliceChoice(
        ("model.remat=save_attn_out", "train.max_micro_batch_size=2"),
        "olmax compile --sweep, 2026-12-07 (benchmarks/results/compile-sweep-dpo_tpu-aot_2026-12-07.md): "
        "save_attn_out with both of a chip's pairs in one pass needs 78.74 GiB a chip (18% of the HBM free) for "
        "an estimated 10.89 s a step with the splash kernel priced in (est. MFU 64.0%), full remat in two passes "
        "(the recipe) 25.74 GiB for 11.39 s (61.1%) and in one 45.93 GiB for 11.30 s; XLA alone, which cannot "
        "see the kernel, costs all three 9.6 to 9.7 s; minimal does not fit one pair (102.96 GiB)"),
    ("olmo3_7b_stage3", "v5p-512"): SliceChoice(
        ("model.remat=save_attn_out",),
        "olmax compile --sweep, 2026-12-06 (benchmarks/results/compile-sweep-stage3_tpu-aot_2026-12-06.md): "
        "save_attn_out needs 79.99 GiB a chip (16% of the HBM free) for an estimated 12.66 s a step with the "
        "splash kernel priced in (est. MFU 66.4%), full remat 41.32 GiB for 13.63 s (61.7%); XLA alone, "
        "blind to the kernel, costs both 9.73 s"),
    ("olmo3_32b", "v5p-512"): SliceChoice(
        ("model.remat=save_proj_except_out", "train.max_micro_batch_size=1"),
        "olmax compile --sweep, 2026-12-07 (benchmarks/results/compile-sweep-32b_tpu-aot_2026-12-07.md): "
        "save_proj_except_out, one sequence a pass, needs 85.49 GiB a chip (10.7% of the HBM free) for an "
        "estimated 10.33 s a step with the splash kernel priced in (est. MFU 70.3%), save_attn_out 2 a pass "
        "45.97 GiB for 11.59 s (62.7%), full remat 25.97 GiB for 11.77 s (61.7%); save_proj does not fit one "
        "sequence (95.75 GiB)"),
    ("olmo3_7b_think_rl", "v5p-128"): SliceChoice(
        ("model.remat=save_attn_out",),
        "olmax compile --sweep, 2026-12-06 (benchmarks/results/compile-sweep-rl_tpu-aot_2026-12-06.md): the "
        "GRPO update under save_attn_out needs 43.88 GiB a chip (54% of the HBM free) for an estimated 50.98 s "
        "with the splash kernel priced in (est. MFU 62.8%), full remat 27.09 GiB for 53.65 s (59.6%); minimal "
        "does not fit (112.22 GiB); sampling is not affected"),
    ("olmo3_7b_instruct_rl", "v5p-128"): SliceChoice(
        ("model.remat=save_proj",),
        "olmax compile --sweep, 2026-12-07 (benchmarks/results/compile-sweep-instruct-rl_tpu-aot_2026-12-07.md): "
        "a GRPO mini-batch update under save_proj needs 45.20 GiB a chip (53% of the HBM free) for an estimated "
        "3.12 s with the splash kernel priced in (est. MFU 67.6%), full remat 11.34 GiB for 3.90 s (53.9%); "
        "minimal 42.10 GiB for 3.14 s; sampling is not affected"),
    ("olmo3_7b_think_sft", "v5p-128"): SliceChoice(
        ("model.remat=minimal",),
        "olmax compile --sweep, 2026-12-06 (benchmarks/results/compile-sweep-sft_tpu-aot_2026-12-06.md): "
        "minimal needs 84.21 GiB a chip (12% of the HBM free) for XLA's estimated 2.05 s a step against the "
        "recipe's save_attn_out 2.61 s (35.72 GiB); with the splash kernel's work, which XLA does not see, "
        "about 2.65 s against 3.06 s; save_proj leaves 8%"),
}


# Recipes that compile the same programs as another: they differ only in the learning rate, the
# schedule's length and the number of steps, none of which changes a program's shapes, memory or
# FLOPs. A measurement of the one holds for the other (tests/test_launch.py checks the difference).
SAME_PROGRAMS: dict[str, str] = {
    "olmo3_7b_instruct_sft": "olmo3_7b_think_sft",
    "olmo3_7b_instruct_dpo": "olmo3_7b_think_dpo",
}


def slice_choice(recipe: str, slice_name: str | None) -> SliceChoice | None:
    """The measured choice for ``recipe`` on the slice named ``slice_name`` (e.g. ``v5p-128``, one
    slice), None where there is none. A recipe in ``SAME_PROGRAMS`` takes its twin's, saying so."""
    if not slice_name:
        return None
    if (recipe, slice_name) in CHOICES:
        return CHOICES[recipe, slice_name]
    twin = SAME_PROGRAMS.get(recipe)
    choice = CHOICES.get((twin, slice_name)) if twin else None
    if choice is None:
        return None
    return SliceChoice(choice.overrides, f"as {twin}, whose programs it shares (only the learning rate and the "
                                         f"number of steps differ): {choice.why}")
