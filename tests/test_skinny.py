"""specnb.skinny: the C++ kernel for products of a few rows, against torch's product, in both of its
instruction sets (AVX-512 and AVX2), with several weights per call."""
import os

import pytest
import torch
import torch.nn.functional as F

from specnb import skinny

# CI installs a compiler (.ci/run): there the tests fail, naming why, instead of skipping
needs_kernel = pytest.mark.skipif(skinny.unavailable() is not None and not os.environ.get("CI"),
                                  reason=f"skinny kernels: {skinny.unavailable()}")

SHAPES = [(1, 7), (5, 17), (3, 33), (576, 576), (961, 577), (40, 1536)]  # (N, K): tails in N and in K


def _check(linear, rows: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    ws = [torch.randn(n, k, generator=g), torch.randn(n + 3, k, generator=g)]
    bs = [torch.randn(n, generator=g), None]
    y = linear(x, ws, bs)
    ref = torch.cat([F.linear(x, ws[0], bs[0]), F.linear(x, ws[1])], -1)
    assert y.shape == ref.shape
    # float32 sums of k products in another order: about sqrt(k) * 1e-7 of their size
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 10, 16])
@pytest.mark.parametrize("n, k", SHAPES)
def test_the_products_match_torch(rows, n, k):
    _check(skinny.linear, rows, n, k)


@needs_kernel
def test_batched_input_keeps_its_shape_and_a_wrong_width_is_refused():
    x, w = torch.randn(2, 3, 64), torch.randn(10, 64)
    assert skinny.linear(x, [w]).shape == (2, 3, 10)
    torch.testing.assert_close(skinny.linear(x, [w]), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="features"):
        skinny.linear(torch.randn(1, 63), [w])
    with pytest.raises(RuntimeError, match="float32"):
        skinny.linear(x.bfloat16(), [w])


@needs_kernel
def test_a_broken_kernel_is_caught():
    """Negative control: the same check must fail for a kernel that drops the K tail."""
    def no_tail(x, ws, bs=None):
        k = x.shape[-1] // 16 * 16
        return skinny.linear(x[..., :k].contiguous(), [w[:, :k].contiguous() for w in ws], bs)

    with pytest.raises(AssertionError):
        _check(no_tail, 3, 5, 17)


@needs_kernel
def test_the_avx2_build_matches_torch_too(tmp_path):
    """Where the CPU has AVX-512, build the AVX2 variant as well (-mno-avx512f), so both paths are tested."""
    if skinny.isa() != "AVX-512":
        pytest.skip("this CPU's build is already the AVX2 one (tested above)")
    from torch.utils import cpp_extension

    ext = cpp_extension.load("specnb_skinny_avx2_test", [str(skinny.SOURCE)], build_directory=str(tmp_path),
                             extra_cflags=["-O3", "-march=native", "-mno-avx512f", "-fopenmp"],
                             extra_ldflags=["-fopenmp"])
    assert ext.isa() == "AVX2"
    for rows in (1, 2, 3, 5):
        for n, k in SHAPES:
            _check(lambda x, ws, bs=None: ext.linear(x, ws, bs or [None] * len(ws), 1), rows, n, k)


def test_why_it_cannot_run_is_named(monkeypatch, tmp_path):
    """Each reason the kernel cannot be built here is one phrase naming the fix (runs on any machine)."""
    flags = {"avx2", "fma", "avx512f"}
    monkeypatch.setattr(skinny, "SOURCE", tmp_path / "gone.cpp")
    assert "missing from this install" in skinny._missing(flags)
    monkeypatch.setattr(skinny, "SOURCE", tmp_path)  # exists
    assert "neither AVX-512 nor AVX2" in skinny._missing({"sse2"})
    monkeypatch.setattr(skinny.shutil, "which", lambda name: None)
    assert "no C++ compiler" in skinny._missing(flags)
