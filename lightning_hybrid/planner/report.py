"""The text of ``lightning-hybrid plan``'s reports: the ranked table, a layout's step-time split, the GPU figures."""

from __future__ import annotations

from lightning_hybrid.hardware import GPU
from lightning_hybrid.planner.layout import Estimate, Layout

__all__ = ["gpu_figures", "format_table", "explain_time"]


def gpu_figures(gpu: GPU) -> dict[str, object]:
    """The GPU's figures the plan used, as the JSON report lists them (peaks in TFLOP/s)."""
    return {"name": gpu.name, "memory_gb": gpu.memory_gb, "peak_tflops": gpu.peak_tflops,
            "fp32_tflops": gpu.fp32_tflops, "nvlink_gbs": gpu.nvlink_gbs, "network_gbits": gpu.network_gbits,
            "hbm_tbs": gpu.hbm_tbs, "nvlinks": gpu.nvlinks, "pcie_gen": gpu.pcie_gen}


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _dp_mode(layout: Layout) -> str:
    """The data-parallel column: the mode, HSDP with its shard group (``hsdp/8``), ``none`` without dp."""
    if layout.dp == 1:
        return "none"
    return f"hsdp/{layout.dp_shard}" if layout.data_parallel == "hsdp" else layout.data_parallel


def format_table(rows: list[Estimate]) -> str:
    """The ranked table: layout, memory breakdown (GB), step time breakdown (s), MFU, tokens/s."""
    head = (f"{'#':>3} {'tp':>2} {'cp':>2} {'pp':>3} {'dp':>3} {'dp-mode':<9} {'mbs':>3} {'m':>4} {'schedule':<13} "
            f"{'recomp':<9} {'sp':<2} | {'wts':>5} {'grad':>5} {'opt':>5} {'act':>6} {'other':>5} {'total':>6} "
            f"/{'usable':>6} | {'step':>6} {'comp':>6} {'recomp':>6} {'tp+cp':>6} {'bubble':>6} {'dp':>6} | {'MFU':>5} "
            f"{'tok/s':>8}")
    lines = [head, "-" * len(head)]
    for i, e in enumerate(rows, 1):
        L, m, t = e.layout, e.memory, e.time
        sched = "-" if L.pp == 1 else L.schedule.replace("interleaved_", "il-") + (
            f" v={L.virtual_stages}" if L.virtual_stages > 1 else "")
        other = m["working"] + m["fsdp_buffers"] + m["autocast_copies"]
        lines.append(
            f"{i:>3} {L.tp:>2} {L.cp:>2} {L.pp:>3} {L.dp:>3} {_dp_mode(L):<9} "
            f"{L.micro_batch_size:>3} {L.microbatches:>4} {sched:<13} {L.recompute:<9} "
            f"{('y' if L.sequence_parallel else 'n'):<2} | {_gb(m['weights']):>5} {_gb(m['gradients']):>5} "
            f"{_gb(m['optimizer']):>5} {_gb(m['activations']):>6} {_gb(other):>5} {_gb(m['total']):>6} "
            f"/{_gb(e.usable):>6} | {t['step']:>6.2f} {t['compute']:>6.2f} {t['recompute']:>6.2f} "
            f"{t['tp_comm'] + t.get('cp_comm', 0.0):>6.2f} {t['pp_bubble']:>6.2f} "
            f"{t['dp_comm'] + t['optimizer']:>6.2f} | {e.mfu:>5.1%} "
            f"{e.tokens_per_second:>8.0f}")
    return "\n".join(lines)


def explain_time(e: Estimate) -> list[str]:
    """How a layout's step time splits: compute (GEMMs with their efficiency, attention, elementwise ops), exposed
    TP, exposed DP, pipeline bubble, recompute and the optimizer step, one line each."""
    t, d = e.time, e.detail
    step = t["step"]
    effs = ", ".join(f"{name} {eff:.2f}" for name, eff in d["gemm_efficiencies"].items())
    first, shape = next(iter(d["gemm_shapes"].items()))
    rows = [("compute", t["compute"], f"GEMMs {d['gemm']:.2f} s at {d['gemm_efficiency']:.2f} of peak "
             f"(FLOP-weighted; per GEMM {effs}; tokens x in x out e.g. {first} {' x '.join(map(str, shape))}), "
             f"attention {d['attention']:.2f} s, elementwise ops {d['elementwise']:.2f} s"),
            ("exposed TP", t["tp_comm"], "activation all-reduces (or SP reduce-scatter + all-gather) in the "
             "critical path, 4 per block and micro-batch"),
            ("exposed DP", t["dp_comm"], "gradient all-reduce / FSDP gathers and reduce-scatters not hidden"),
            ("bubble", t["pp_bubble"], "pipeline warm-up and cool-down, with their point-to-point transfers"),
            ("recompute", t["recompute"], "the forward re-run in backward"),
            ("optimizer", t["optimizer"], "AdamW step at HBM bandwidth")]
    lines = [f"step time of {e.layout.describe()}: {step:.2f} s, MFU {e.mfu:.1%}, {e.tokens_per_second:,.0f} tokens/s"]
    lines += [f"  {name:<11} {sec:>7.2f} s {sec / step:>6.1%}  {why}" for name, sec, why in rows]
    return lines
