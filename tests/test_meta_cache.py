"""The virtual GPU's meta kernels run once per input signature, and only where that is safe."""

from __future__ import annotations

import pytest
import torch

from memprof.collect.virtual import meta_cache
from memprof.collect.virtual.meta_cache import MetaCache

calls: list[tuple[int, ...]] = []


@torch.library.custom_op("memprof_test::outer", mutates_args=())
def outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.outer(a, b)


@outer.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    calls.append((a.shape[0], b.shape[0]))
    return a.new_empty(a.shape[0], b.shape[0])


OUTER = torch.ops.memprof_test.outer.default


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def test_a_signature_runs_its_kernel_once_and_each_call_gets_fresh_outputs() -> None:
    run, calls[:] = MetaCache(), []
    first = run(OUTER, (meta(3), meta(5)), {})
    again = run(OUTER, (meta(3), meta(5)), {})
    other = run(OUTER, (meta(4), meta(5)), {})
    assert calls == [(3, 5), (4, 5)]
    assert again.shape == (3, 5) and again.stride() == (5, 1) and other.shape == (4, 5)
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata
    assert again.untyped_storage().nbytes() == 3 * 5 * 4


def test_strides_dtypes_and_arguments_are_part_of_the_signature() -> None:
    run = MetaCache()
    add = torch.ops.aten.add.Tensor
    assert run(add, (meta(4, 6), meta(4, 6)), {}).stride() == (6, 1)
    assert run(add, (meta(6, 4).t(), meta(6, 4).t()), {}).stride() == (1, 4)
    assert run(add, (meta(4, 6, dtype=torch.bfloat16), meta(4, 6)), {}).dtype == torch.float32
    total = torch.ops.aten.sum.dim_IntList
    assert run(total, (meta(4, 6), [0]), {}).shape == (6,)
    assert run(total, (meta(4, 6), [1]), {}).shape == (4,)
    assert run(total, (meta(4, 6), [1]), {"keepdim": True}).shape == (4, 1)


def test_views_and_metadata_changing_in_place_operators_always_run_their_kernels() -> None:
    run = MetaCache()
    x = meta(4, 6)
    for _ in range(2):
        view = run(torch.ops.aten.view.default, (x, [24]), {})
        assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
        y = meta(4, 6)
        assert run(torch.ops.aten.resize_.default, (y, [10]), {}) is y and y.shape == (10,)


def test_in_place_pointwise_operators_return_their_input_once_checked() -> None:
    run = MetaCache()
    for _ in range(2):
        x = meta(4, 6)
        assert run(torch.ops.aten.add_.Tensor, (x, meta(6)), {}) is x
        assert x.shape == (4, 6)
    with pytest.raises(RuntimeError):  # a new signature runs the kernel's checks
        run(torch.ops.aten.add_.Tensor, (meta(4, 6), meta(5)), {})


def test_a_full_cache_starts_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meta_cache, "_LIMIT", 2)
    run, calls[:] = MetaCache(), []
    for n in (1, 2, 1, 3, 3, 1):
        run(OUTER, (meta(n), meta(5)), {})
    assert calls == [(1, 5), (2, 5), (3, 5), (1, 5)]  # the third signature emptied it
