"""Receive targets (:mod:`refit_worker.rollout.targets`): in place and double-buffered bookkeeping.

Pure: real modules and tensors, no NIXL (transfers: ``tests/e2e/test_nixl_receive_modes.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refit_worker.rollout.targets import DoubleBuffer, OwnState, check_mode, live_tensors


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    net.register_buffer("steps", torch.zeros(1))
    return net


def test_live_tensors_of_a_module_are_its_parameters_and_the_sent_buffers() -> None:
    net = model()
    got = live_tensors(net, ["0.weight", "steps"])
    assert set(got) == {"0.weight", "0.bias", "1.weight", "1.bias", "steps"}
    assert got["0.weight"].data_ptr() == net[0].weight.data_ptr()  # the live memory
    assert not got["0.weight"].requires_grad
    assert set(live_tensors(net, ["0.weight"])) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    with pytest.raises(TypeError, match=r"nn\.Module or a mutable mapping"):
        live_tensors([1, 2], [])  # type: ignore[arg-type]


def test_double_buffer_swaps_a_module_to_the_filled_copy_and_keeps_the_old_as_spare() -> None:
    net = model()
    names = [n for n, _ in net.named_parameters()]
    served = {n: p.data_ptr() for n, p in net.named_parameters()}
    double = DoubleBuffer(net)
    spare = double.spare(names)
    assert all(spare[n].data_ptr() != served[n] for n in names)
    for tensor in spare.values():
        tensor.fill_(7.0)
    filled_ptrs = {n: t.data_ptr() for n, t in spare.items()}
    double.swap()
    assert {n: p.data_ptr() for n, p in net.named_parameters()} == filled_ptrs
    assert all(torch.all(p == 7.0) for p in net.parameters())
    assert isinstance(net[0].weight, nn.Parameter)  # still a parameter, same object kind
    again = double.spare(names)
    assert {n: t.data_ptr() for n, t in again.items()} == served  # the old memory is reused


def test_double_buffer_on_a_state_dict_replaces_values_and_reallocates_on_a_new_layout() -> None:
    state = {"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.int64)}
    double = DoubleBuffer(state)
    spare = double.spare(["a", "b"])
    spare["a"].fill_(5)
    spare["b"].fill_(9)
    old_a = state["a"]
    double.swap()
    assert torch.equal(state["a"], torch.full((3,), 5.0)) and state["a"] is not old_a
    state["a"] = torch.zeros(4)  # the served layout changed
    assert double.spare(["a", "b"])["a"].shape == (4,)


def test_own_state_alternates_two_copies() -> None:
    own = OwnState()
    shapes = {"w": ((2, 2), torch.float32)}
    first = own.spare(shapes, torch.device("cpu"))["w"].data_ptr()
    own.swap()
    second = own.spare(shapes, torch.device("cpu"))["w"].data_ptr()
    assert first != second and own.served["w"].data_ptr() == first
    own.swap()
    assert own.spare(shapes, torch.device("cpu"))["w"].data_ptr() == first


def test_mode_names_are_checked() -> None:
    assert check_mode("in_place") == "in_place"
    with pytest.raises(ValueError, match=r"mode must be one of \['double_buffer', 'in_place'\]"):
        check_mode("inplace")
