"""Triton quantization kernels against the PyTorch reference, bit for bit.

On a CUDA machine the comparison tests run natively. Without CUDA they run in Triton's CPU
interpreter, which has to be switched on (``TRITON_INTERPRET=1``) before Triton is imported;
since other test modules may already have imported it, ``test_interpreter_in_subprocess``
re-runs this file in a fresh interpreter with that variable (and ``GACT_GRAPH_FORCE_TRITON=1``)
set. Running the file directly with ``TRITON_INTERPRET=1`` works too.
"""

import importlib.util
import subprocess
import sys

import pytest
import torch

from gact_graph.core.quantize import SUPPORTED_BITS, _use_triton, quantize
from gact_graph.kernels import quantize as kq
from tests.kernels.interpreted import (
    DEVICE,
    HAS_CUDA,
    HAS_TRITON,
    INTERPRETED,
    REPO,
    interpreter_test,
    needs_kernels,
)

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN matching NaN (NaN payloads may differ)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))


def assert_matches_reference(x: torch.Tensor, bits: int, group_size: int = 256, seed: int = 3):
    packed, meta = kq.triton_quantize(x, bits, group_size, seed)
    ref_packed, ref_meta = kq.quantize_reference(x.cpu(), bits, group_size, seed)
    assert torch.equal(packed.cpu(), ref_packed), "packed codes differ"
    assert torch.equal(meta.view(torch.int16).cpu(), ref_meta.view(torch.int16)), "metadata"
    y = kq.triton_dequantize(packed, meta, bits, x.shape, x.dtype, group_size)
    y_ref = kq.dequantize_reference(ref_packed, ref_meta, bits, x.shape, x.dtype, group_size)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert same_values(y.cpu(), y_ref), "dequantized values differ"


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """x with a NaN group, an Inf group, a constant (non-bf16) row and a constant zero row."""
    x = x.clone()
    x[1, 5] = float("nan")
    x[2, -1] = float("inf")
    x[3] = 0.3
    x[4] = -0.0
    return x


@needs_kernels
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_all_bits_and_dtypes(dtype):
    # the dtype only touches loads and stores, the bits only the packing: fp32 takes every
    # width, the other dtypes the two packing branches (several codes per byte, one per byte)
    torch.manual_seed(0)
    x = with_specials(torch.randn(7, 781) * 3).to(DEVICE, dtype)
    for bits in SUPPORTED_BITS if dtype == torch.float32 else (1, 8):
        assert_matches_reference(x, bits)


@needs_kernels
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(700, 13),  # whole rows per group, partial last group
        lambda: torch.randn(5),
        lambda: torch.tensor(2.5),
        lambda: torch.randn(3, 4, 300),
        lambda: torch.randn(33, 100),
        lambda: torch.randn(9, 256),
        lambda: torch.randn(300, 11).t(),  # strided 2-D view, read in place
        lambda: torch.randn(40, 3, 30).permute(2, 0, 1),  # needs a copy
        lambda: torch.randn(2, 90)[:, ::3],
        lambda: torch.randn(0, 7),
    ],
)
def test_awkward_shapes_and_strides(make):
    torch.manual_seed(1)
    x = make().to(DEVICE)
    for bits in (1, 4):
        assert_matches_reference(x, bits)


@needs_kernels
@pytest.mark.parametrize("bits", [2, 8])
def test_fp16_near_its_maximum_stays_finite(bits):
    # the bf16 range stored per group is rounded outward; near 65504 its top level is not an
    # fp16 number: the kernel clamps like the reference, a NaN group stays NaN
    g = torch.Generator().manual_seed(bits)
    x = ((torch.rand(64, 256, generator=g) * 2 - 1) * 65504).half()
    x[:, 0] = 65504
    x[5, 3] = float("nan")
    x = x.to(DEVICE)
    assert_matches_reference(x, bits)
    y = kq.triton_dequantize(*kq.triton_quantize(x, bits, 256, 3), bits, x.shape, x.dtype, 256)
    assert torch.isnan(y[5]).all() and torch.isfinite(torch.cat([y[:5], y[6:]])).all()


@needs_kernels
@pytest.mark.parametrize("group_size", [1, 8, 64, 1000])
def test_group_sizes(group_size):
    torch.manual_seed(2)
    x = with_specials(torch.randn(11, 150)).to(DEVICE)
    for bits in (1, 4):
        assert_matches_reference(x, bits, group_size=group_size, seed=group_size)


@needs_kernels
@pytest.mark.parametrize("shape", [(40, 16), (9, 300)])  # groups of rows / rows split in groups
def test_row_slices_dequantize_from_an_offset_view(shape):
    """`QTensor.rows` hands the kernel codes and metadata that start inside the tensor's own
    (the sensitivity probe's row-chunked matmul backward, `gact_graph.core.chunked`)."""
    torch.manual_seed(4)
    q = quantize(torch.randn(shape, device=DEVICE), 2, seed=5)
    assert _use_triton(q.packed)
    full = q.dequantize()
    step = q.row_step()
    part = q.rows(step, shape[0])
    assert part.packed.storage_offset() > 0
    assert same_values(part.dequantize().cpu(), full[step:].cpu())


@needs_kernels
def test_public_api_dispatches_to_triton():
    x = torch.randn(20, 300, device=DEVICE)
    assert _use_triton(x)
    q = quantize(x, 2, seed=9)
    ref_packed, ref_meta = kq.quantize_reference(x.cpu(), 2, 256, 9)
    assert torch.equal(q.packed.cpu(), ref_packed)
    y = q.dequantize()
    assert y.device == x.device
    assert same_values(y.cpu(), kq.dequantize_reference(ref_packed, ref_meta, 2, x.shape, x.dtype))


@needs_kernels
@pytest.mark.parametrize("cfg", list(kq.CONFIGS))
def test_every_tuned_configuration_gives_the_same_bits(cfg, monkeypatch):
    """The autotuner may pick any of `CONFIGS` (programs, warps, threads per group, run
    length): the results never depend on it. Dense rows, a dense layout whose last group ends
    early (its own launch), padded groups, and bf16 input."""
    monkeypatch.setattr(kq, "_TUNED", {})
    torch.manual_seed(5)
    with kq.forced_config(cfg):
        assert_matches_reference(with_specials(torch.randn(40, 256)).to(DEVICE), 2)
        assert_matches_reference(torch.randn(75, 64).to(DEVICE), 1)  # k = 4, last group 3 rows
        assert_matches_reference(torch.randn(9, 300).to(DEVICE, torch.bfloat16), 4)
        assert_matches_reference(torch.randn(16, 512).to(DEVICE, torch.float16), 8)
    assert not kq._TUNED  # a forced configuration never tunes


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED or not HAS_CUDA, reason="needs CUDA")
def test_cuda_tuner_times_every_configuration_per_dtype(monkeypatch):
    """One large tensor tunes its key (direction, bits, g, element size, dense) once: every
    configuration timed, the fastest chosen; bf16 of the same width tunes separately."""
    monkeypatch.setattr(kq, "_TUNED", {})
    monkeypatch.setattr(kq, "_TIMINGS", {})
    monkeypatch.setenv("GACT_GRAPH_AUTOTUNE", "1")
    x = torch.randn(kq.TUNE_MIN_ELEMS // 256, 256, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        packed, meta = kq.triton_quantize(x.to(dtype), 2, 256, 1)
        kq.triton_dequantize(packed, meta, 2, x.shape, dtype, 256)
    log = kq.tuning_log()
    for es in (4, 2):
        for kind in ("quantize", "dequantize"):
            chosen, times = log[(kind, 2, 256, es, True)]
            assert set(times) == set(kq.CONFIGS) and all(t > 0 for t in times.values())
            assert times[chosen] == min(times.values())


@needs_kernels
@pytest.mark.parametrize("bits", [1, 8])
def test_wide_path_keys_every_element_like_the_narrow_one(bits, monkeypatch):
    """Tensors past 2**32 padded elements key the RNG per element from the offset's high
    word; below that both paths give the same bits (the high word is 0)."""
    monkeypatch.setattr(kq, "WIDE_FROM", 0)
    torch.manual_seed(6)
    assert_matches_reference(with_specials(torch.randn(20, 256)).to(DEVICE), bits)
    assert_matches_reference(torch.randn(33, 100).to(DEVICE), bits)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_tile_shapes_cover_a_group():
    for g in (8, 16, 64, 200, 256, 1000):
        for bits in SUPPORTED_BITS:
            for es in (2, 4, 8):
                for threads in (1, 4, 8, 32):
                    for run in (1, 4, 8, 16):
                        h, t, v = kq.tile_shape(g, bits, es, threads, run)
                        assert h * t * v == triton.next_power_of_2(g)
                        assert v % (8 // bits) == 0 and t <= threads
                        assert v >= min(run, triton.next_power_of_2(g)) and v * es >= min(
                            16, triton.next_power_of_2(g) * es
                        )


if HAS_TRITON:
    import triton
    import triton.language as tl

    from gact_graph.kernels.rng import uniform

    @triton.jit
    def _uniform_kernel(offsets_ptr, out_ptr, seed, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        off = tl.load(offsets_ptr + i, mask=i < n, other=0)
        tl.store(out_ptr + i, uniform(seed, off), mask=i < n)


@needs_kernels
def test_triton_uniform_matches_reference_for_64_bit_offsets():
    from gact_graph.kernels.rng import uniform_reference

    offsets = torch.tensor(
        [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**62 + 5],
        dtype=torch.int64,
        device=DEVICE,
    )
    for seed in (0, 12345, 2**31 - 2, 2**32 - 1):
        out = torch.empty(offsets.numel(), dtype=torch.float32, device=DEVICE)
        _uniform_kernel[(1,)](offsets, out, seed, offsets.numel(), BLOCK=16)
        assert torch.equal(out.cpu(), uniform_reference(seed, offsets.cpu()))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs CUDA and Triton")
def test_cuda_large_matches_reference():
    torch.manual_seed(3)
    x = with_specials(torch.randn(169343, 256, device="cuda"))
    for bits in SUPPORTED_BITS:
        assert_matches_reference(x, bits)
    assert_matches_reference(x.half()[:, :200], 2)
    assert_matches_reference(torch.randn(70000, 7, device="cuda", dtype=torch.bfloat16), 4)


test_interpreter_in_subprocess = interpreter_test(
    "not subprocess and not cuda and not compiled", GACT_GRAPH_FORCE_TRITON="1"
)


def test_our_modules_import_neither_triton_nor_cuda():
    # The package __init__ pulls in torch_geometric, which imports torch._dynamo and, through
    # it, Triton; so the modules are loaded under a bare parent package to test them alone.
    code = (
        "import sys, types, torch\n"
        f"pkg = types.ModuleType('gact_graph'); pkg.__path__ = [{str(REPO / 'gact_graph')!r}]\n"
        "sys.modules['gact_graph'] = pkg\n"
        "import gact_graph.core.quantize, gact_graph.kernels, gact_graph.kernels.bitpack\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialized'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.skipif(INTERPRETED, reason="compiled kernels only")
def test_compiled_seed_is_never_a_compile_time_constant():
    """Triton compiles an int argument equal to 1 as a constant; a seed of 1 then reached the
    RNG as a Python int and the kernel failed to compile on CUDA (the interpreter never
    specializes, so only this check sees it on a CPU machine). The same holds for the key the
    seed becomes, and for the sizes (a new variant per size divisible by 16 would compile)."""
    for k in (kq._quantize_pack_kernel, kq._unpack_dequantize_kernel):
        names = {k.arg_names[i] if isinstance(i, int) else i for i in k.do_not_specialize}
        assert {"numel", "num_groups", "group0"} <= names
    names = {kq._quantize_pack_kernel.arg_names[i] if isinstance(i, int) else i
             for i in kq._quantize_pack_kernel.do_not_specialize}  # fmt: skip
    assert "key" in names


# ---------------------------------------------------------------------------------------------
# the uniforms: one 32-bit hash per pair of elements, 16 bits each


def _round_ups(x: torch.Tensor, bits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``x`` (one row per group) from the reference, and each element's ``t``."""
    packed, meta = kq.quantize_reference(x, bits, x.shape[1], seed)
    from gact_graph.kernels.bitpack import unpack_bits

    codes = unpack_bits(packed, bits, x.numel()).view(x.shape).float()
    lo_b, s = meta.float().unbind(1)
    return codes, (x - lo_b[:, None]) * (1.0 / s[:, None])


def test_uniforms_are_multiples_of_2_pow_16_and_uniform():
    from gact_graph.kernels.rng import U_BITS, uniform_range_reference

    assert U_BITS == 16
    u = uniform_range_reference(5, 2**32 - 2**19, 2**20)  # crosses a key segment
    m = u * 2**16
    assert torch.equal(m, m.floor()) and float(m.min()) >= 0 and float(m.max()) < 2**16
    # chi-square over 256 equal bins of the low 8 of the 16 bits and the high 8 bits
    for bins in (m.long() & 255, m.long() >> 8):
        counts = torch.bincount(bins, minlength=256).double()
        chi2 = float(((counts - 2**12) ** 2 / 2**12).sum())
        assert chi2 < 255 + 6 * (2 * 255) ** 0.5  # mean 255, sd 22.6


@pytest.mark.parametrize("fracs", [(0.5, 0.5), (0.3, 0.3), (0.7, 0.2)])
def test_the_two_uniforms_of_a_hash_are_independent(fracs):
    """Neighbours sharing a hash word (even offset: low half, odd: high half) round up jointly
    with probability p_even * p_odd. A split that reused or mirrored the bits (u_odd = u_even,
    or 1 - u_even) would give p or 0 at equal fractional parts."""
    fe, fo = fracs
    rows, g = 1024, 256
    x = torch.empty(rows, g)
    x[:, 0::2] = 1.0 + fe  # fp32 value; t below is measured, not assumed
    x[:, 1::2] = 1.0 + fo
    x[:, 0], x[:, 1] = 0.0, 3.0  # every group's range [0, 3]; this pair is left out
    codes, t = _round_ups(x, 2, seed=123)
    up = codes > t.floor()
    ue, uo = up[:, 2::2].reshape(-1).double(), up[:, 3::2].reshape(-1).double()
    pe, po = (t[0, 2] - t[0, 2].floor()).item(), (t[0, 3] - t[0, 3].floor()).item()
    n = ue.numel()
    for p, u in ((pe, ue), (po, uo)):
        assert abs(u.mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5
    joint = (ue * uo).mean().item()
    sd = (pe * po * (1 - pe * po) / n) ** 0.5
    assert abs(joint - pe * po) < 5 * sd
    # neighbouring pairs (different hash words) are independent too
    nxt = (uo[:-1] * ue[1:]).mean().item()
    assert abs(nxt - pe * po) < 5 * sd


def test_rounding_resolution_is_2_pow_16():
    """u has 16 bits: a fractional part below 2**-16 of a step never rounds up (the bias of
    the stochastic rounding is at most 2**-16 of a step), and over the 2**16 values of u every
    fractional part f is reproduced within 2**-16."""
    rows, g = 2048, 256  # at 24 bits about 4 of these elements would round up
    x = torch.full((rows, g), 1.0 + 2.0**-17)
    x[:, 0], x[:, 1] = 0.0, 3.0
    codes, t = _round_ups(x, 2, seed=9)
    assert t[0, 2].item() == 1.0 + 2.0**-17  # scale 1, lo 0: t is x
    assert torch.equal(codes[:, 2:], torch.ones(rows, g - 2))
    # the contract's expectation, enumerated over every u = m * 2**-16
    u_half = (torch.arange(2**16, dtype=torch.float32) - 2**15) * 2.0**-16
    for f in (2.0**-17, 2.0**-16, 3 * 2.0**-17, 0.1, 0.5, 0.75, 1 - 2.0**-17):
        tt = torch.tensor(1.0 + f, dtype=torch.float32)
        mean = (tt + u_half).round().double().mean().item()
        assert abs(mean - (1.0 + f)) <= 2.0**-16
