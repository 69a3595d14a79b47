"""Launch policy: whether a plan's forward CTAs go out in one fused launch.

One rule, read by the CUDA backend (:class:`pat_core.cuda_backend.CudaBackend`) and by the
simulator (:func:`sim.model.prepare`), so that the simulator prices the launch the GPU runs.

``"streams"``: one launch per tile group, groups on pooled streams.  ``"fused"``: every forward
CTA in one launch, each block running its CTA's variant with the largest variant's threads,
registers and shared memory.  ``"auto"`` (the default): fused when the plan is not serial and has two
or more tile variants, at most ``max_blocks_per_sm`` thread blocks (CTAs x KV heads) per SM and no CTA longer
than ``max_kv_len`` tokens: such a step is bound by launch latency and the tail of the slowest
group, not by occupancy, which the fused block costs the small tiles.  With long CTAs the step
lasts hundreds of microseconds and the launches do not matter: on decode steps of a real chat
trace (12k-token prompts, 10-45 requests) the fused launch measured 5-14% slower than the
streams (``bench/results/trace_replay_h100/``).
"""
from __future__ import annotations

LAUNCH_MODES = ("auto", "fused", "streams")
FUSED_MAX_BLOCKS_PER_SM = 4
FUSED_MAX_KV_LEN = 2048


def use_fused_launch(plan, num_sms: int, mode: str = "auto",
                     max_blocks_per_sm: int = FUSED_MAX_BLOCKS_PER_SM,
                     max_kv_len: int = FUSED_MAX_KV_LEN) -> bool:
    """Whether ``plan``'s forward CTAs run in one launch under ``mode`` on ``num_sms`` SMs."""
    if mode not in LAUNCH_MODES:
        raise ValueError(f"launch_mode must be one of {LAUNCH_MODES}, got {mode!r}")
    if plan.num_ctas == 0:
        return False
    if mode == "fused":
        return True
    if mode == "streams" or plan.serial or len(set(plan.group_tile.tolist())) < 2:
        return False                # serial plans keep their order; one variant, one launch
    if int(plan.cta_kv_len.max()) > max_kv_len:
        return False
    return plan.num_ctas * plan.num_kv_heads <= max_blocks_per_sm * num_sms
