"""Comparisons of tensors and of training records (``dist_worker.py``'s records, ``run_reference``'s)."""

from __future__ import annotations

import torch

from helpers.equivalence import STEPS

__all__ = ["TOL", "same_tensors", "local_tensor", "max_relative_error", "assert_trains_like"]

# fp32 rounding from another reduction order; anything else is a bug. Margin: the one process against itself with
# its initial weights rounded once differently (each element times 1 +- 2**-24, 20 seeds) ends 1.1e-7 to 1.9e-7
# apart in the weights and <= 2.6e-7 in the losses (helpers.equivalence's problem, lr 1e-3): a mesh whose every
# reduction rounds differently (independent roundings add in quadrature) stays below 1e-5 up to thousands of them.
TOL = 1e-5


def same_tensors(a: dict, b: dict) -> bool:
    """The same names, and bitwise equal tensors under every name."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def max_relative_error(record: dict, reference: dict, steps: int = STEPS) -> dict[str, float]:
    """Worst relative error of the losses (``steps`` of them) and of the final weights (norm of the difference)."""
    losses = max(abs(a - b) / abs(b) for a, b in zip(record["losses"], reference["losses"]))
    assert len(record["losses"]) == len(reference["losses"]) == steps, (record["losses"], reference["losses"])
    assert record["final"].keys() == reference["final"].keys(), set(record["final"]) ^ set(reference["final"])
    # Relative error of the whole weight vector. Per tensor it is ill-posed for tensors whose exact
    # gradient is zero (k_proj biases: softmax ignores a constant shift of the keys) and that hold
    # only Adam-normalized rounding noise.
    diff = torch.cat([(record["final"][k] - v).flatten() for k, v in reference["final"].items()])
    full = torch.cat([v.flatten() for v in reference["final"].values()])
    return {"loss": losses, "weights": float(diff.norm() / full.norm())}


def assert_trains_like(record: dict, reference: dict, same_initial_weights: bool = False, steps: int = STEPS) -> None:
    """``record`` trained like the one-process ``reference``: every step's loss (``steps`` of them) and the final
    weights within ``TOL``.

    The reference really trained (its weights moved well beyond the tolerance), so agreeing is not trivial. With
    ``same_initial_weights`` the run must also have started from bitwise the reference's weights.
    """
    err = max_relative_error(record, reference, steps)
    assert err["loss"] < TOL, (err, record["losses"], reference["losses"])
    assert err["weights"] < TOL, err
    # the whole weight vector (per tensor, zero-initialized biases would divide by 0 and pass as inf): 3.5% at lr 1e-3
    initial = torch.cat([v.flatten() for v in reference["initial"].values()])
    final = torch.cat([reference["final"][k].flatten() for k in reference["initial"]])
    assert float((final - initial).norm() / initial.norm()) > 1e-3
    if same_initial_weights:
        for key, value in reference["initial"].items():
            assert torch.equal(record["initial"][key], value), key
