"""Quantization (reference path on CPU; the Triton path is compared in test_kernels_quantize)."""

import math
import os

import pytest
import torch

from gact_graph.core.quantize import SUPPORTED_BITS, GroupLayout, QTensor, group_layout, quantize
from gact_graph.kernels import quantize as kq
from gact_graph.kernels.bitpack import unpack_bits
from gact_graph.kernels.rng import uniform_reference

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
AWKWARD_SHAPES = [(1823, 781), (70000, 7), (5,), (), (3, 4, 300), (33, 256), (2, 1000), (0, 5)]


def element_group(layout: GroupLayout) -> torch.Tensor:
    """Group id of every element of the (rows, cols) view, computed from the definition."""
    r = torch.arange(layout.rows)[:, None]
    c = torch.arange(layout.cols)[None, :]
    if layout.rows_per_group > 1:
        return (r // layout.rows_per_group).expand(layout.rows, layout.cols)
    return r * layout.groups_per_row + c // layout.group_size


def element_params(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element fp32 (lo, scale) of the element's group, shaped like the input."""
    lo, scale = q.group_params()
    idx = element_group(q.layout)
    return lo[idx].reshape(q.shape), scale[idx].reshape(q.shape)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN matching NaN (NaN payloads may differ)."""
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((1823, 781), (7292, 200, 1823, 781, 4, 1)),
        ((70000, 7), (1945, 256, 70000, 7, 1, 36)),  # > 65,535 rows
        ((5,), (1, 8, 5, 1, 1, 5)),  # a group is never larger than the tensor
        ((), (1, 8, 1, 1, 1, 1)),
        ((3, 4, 300), (24, 152, 12, 300, 2, 1)),
        ((4, 256), (4, 256, 4, 256, 1, 1)),
        ((4, 200), (4, 200, 4, 200, 1, 1)),
        ((9, 100), (5, 200, 9, 100, 1, 2)),
        ((0, 5), (0, 8, 0, 5, 1, 1)),
    ],
)
def test_group_layout_values(shape, expected):
    assert tuple(group_layout(shape, 256)) == expected


@pytest.mark.parametrize("group_size", [1, 3, 8, 10, 64, 100, 256, 1000])
@pytest.mark.parametrize("shape", [(7, 1), (5, 3), (4, 4), (6, 9), (3, 257), (11, 781), (2, 2049)])
def test_group_layout_invariants(shape, group_size):
    lay = group_layout(shape, group_size)
    assert lay.group_size % 8 == 0
    group = element_group(lay)
    counts = torch.bincount(group.reshape(-1), minlength=lay.num_groups)
    assert counts.numel() == lay.num_groups
    assert counts.min() >= 1 and counts.max() <= lay.group_size  # no empty group, no overflow
    if lay.rows_per_group > 1:
        assert lay.groups_per_row == 1 and lay.rows_per_group * lay.cols <= lay.group_size
    else:  # a split row: no group holds parts of two rows
        assert torch.equal(
            group // lay.groups_per_row, torch.arange(lay.rows)[:, None].expand_as(group)
        )
        assert lay.group_size < group_size + 8 or lay.groups_per_row == 1
    assert lay.nbytes(2) == lay.num_groups * lay.group_size * 2 // 8 + lay.num_groups * 4


def test_group_layout_rejects_bad_group_size():
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError):
            group_layout((4, 4), bad)


# ---------------------------------------------------------------------------------------------
# API contract
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", AWKWARD_SHAPES)
def test_nbytes_formula_and_metadata(shape):
    x = torch.randn(shape)
    lay = group_layout(shape, 256)
    for bits in SUPPORTED_BITS if x.numel() < 100_000 else (1, 4):
        q = quantize(x, bits, seed=0)
        assert q.layout == lay and q.group_size == lay.group_size and q.bits == bits
        assert q.nbytes == lay.num_groups * lay.group_size * bits // 8 + lay.num_groups * 2 * 2
        assert q.packed.dtype == torch.uint8 and q.meta.dtype == torch.bfloat16
        assert q.meta.shape == (lay.num_groups, 2)
        assert q.shape == x.shape and q.numel() == x.numel() and q.device == x.device


@pytest.mark.parametrize(
    "shape, dtype",
    [(s, d) for s in [(37, 300), (5,), (), (3, 4, 300)] for d in FLOAT_DTYPES]
    + [((70000, 7), torch.float32)],  # > 65,535 rows
)
def test_dequantize_shape_dtype_device_and_error_bound(shape, dtype):
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    for bits in SUPPORTED_BITS:
        q = quantize(x, bits, seed=bits)
        y = q.dequantize()
        assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
        assert y.is_contiguous()
        lo, scale = element_params(q)
        x32, y32 = x.float(), y.float()
        # each value is rounded to one of the two grid points around it
        tol = scale * (1 + 1e-6)
        if dtype in (torch.float16, torch.bfloat16):  # + the final cast
            tol = tol + y32.abs() * torch.finfo(dtype).eps
        assert bool(((y32 - x32).abs() <= tol).all())
        # the grid is lo + k * scale, k in [0, 2^b - 1]
        if dtype in (torch.float32, torch.float64):
            k = torch.where(scale > 0, (y32 - lo) / scale, torch.zeros_like(scale))
            assert bool(((k - k.round()).abs() < 1e-3).all())
            assert k.min() >= 0 and k.max() <= (1 << bits) - 1 + 1e-3


@pytest.mark.parametrize("bits", [3, 0, 16, 32, True])
def test_bits_validation(bits):
    with pytest.raises(ValueError, match=r"\(1, 2, 4, 8\)"):
        quantize(torch.randn(4, 4), bits)


def test_input_requiring_grad_is_not_tracked():
    x = torch.randn(10, 300, requires_grad=True)
    y = quantize(x, 4, seed=0).dequantize()
    assert not y.requires_grad and y.grad_fn is None


def test_type_validation():
    with pytest.raises(TypeError):
        quantize(torch.arange(10), 2)
    with pytest.raises(TypeError):
        quantize(torch.ones(3, dtype=torch.bool), 2)
    with pytest.raises(TypeError):
        quantize([1.0, 2.0], 2)


# ---------------------------------------------------------------------------------------------
# bf16 metadata: range coverage
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_stored_range_covers_and_barely_widens_the_true_range(bits):
    torch.manual_seed(1)
    scales = torch.logspace(-30, 30, 64)[:, None]
    x = torch.randn(64, 512) * scales + torch.randn(64, 1) * scales * 4
    q = quantize(x, bits, seed=0)
    levels = (1 << bits) - 1
    groups = x.view(128, 256)  # C = 512: two groups of 256 per row
    lo_true, hi_true = groups.amin(1), groups.amax(1)
    lo_b, s = q.meta.float().unbind(1)
    assert bool((lo_b <= lo_true).all())
    assert bool((lo_true - lo_b <= lo_true.abs() * 2**-7).all())  # < 1 bf16 ulp below
    top = lo_b + s * levels
    assert bool((top >= hi_true).all())
    # widened by at most the bf16 roundings (lo down, scale up, maybe one more step)
    assert bool((s * levels <= (hi_true - lo_b) * (1 + 2**-6)).all())


def test_zero_range_groups_round_trip_exactly():
    values = [0.0, -0.0, 0.3, -0.3, 1.0, 1e-40, -1e-42, 65504.0, 3.0e38, -3.0e38, 1 / 3]
    x = torch.tensor(values, dtype=torch.float32)[:, None].expand(len(values), 300)
    for bits in SUPPORTED_BITS:
        q = quantize(x, bits, seed=3)
        y = q.dequantize()
        assert torch.equal(y.view(torch.int32), x.contiguous().view(torch.int32))  # signed zeros
        lo, scale = q.group_params()
        assert torch.equal(scale, torch.zeros_like(scale))
        assert torch.equal(lo, x[:, :2].reshape(-1))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        xd = torch.tensor([0.1, -2.5, 0.0], dtype=dtype)[:, None].expand(3, 256)
        assert torch.equal(quantize(xd, 1).dequantize(), xd.to(torch.float32).to(dtype))
    # constant zero groups store code 0 and scale -0.0
    q = quantize(torch.zeros(4, 256), 2, seed=0)
    assert bool((q.packed == 0).all()) and bool((q.meta.float() == 0).all())


# ---------------------------------------------------------------------------------------------
# NaN / Inf
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_non_finite_group_becomes_nan_others_unaffected(bad, bits):
    torch.manual_seed(0)
    x = torch.randn(6, 512)  # groups: (row, half)
    x[2, 300] = bad
    x[4, 3] = bad
    x[4, 4] = -bad
    q = quantize(x, bits, seed=1)
    y = q.dequantize()
    bad_groups = torch.zeros(6, 2, dtype=torch.bool)
    bad_groups[2, 1] = bad_groups[4, 0] = True
    nan_el = bad_groups.repeat_interleave(256, dim=1)
    assert bool(y[nan_el].isnan().all())
    assert bool(y[~nan_el].isfinite().all())
    clean = quantize(torch.where(nan_el, torch.zeros_like(x), x), bits, seed=1).dequantize()
    assert torch.equal(y[~nan_el], clean[~nan_el])  # other groups bit-identical
    lo, scale = q.group_params()
    assert bool(lo.view(6, 2)[bad_groups].isnan().all())
    # NaN lives in the metadata; the codes of those groups are zero
    bpg = 256 * bits // 8
    assert bool((q.packed.view(12, bpg)[bad_groups.view(-1)] == 0).all())


def test_all_nan_and_half_precision_overflow():
    assert bool(quantize(torch.full((3, 7), float("nan")), 2).dequantize().isnan().all())
    x = torch.tensor([1.0, 2.0, 70000.0]).half()  # 70000 -> inf in fp16
    assert bool(quantize(x, 4).dequantize().isnan().all())


# ---------------------------------------------------------------------------------------------
# seeds
# ---------------------------------------------------------------------------------------------


def test_seed_reproducibility():
    x = torch.randn(100, 300)
    a, b, c = quantize(x, 2, seed=7), quantize(x, 2, seed=7), quantize(x, 2, seed=8)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.meta, b.meta)
    assert not torch.equal(a.packed, c.packed)
    assert torch.equal(a.meta, c.meta)  # metadata does not depend on the seed


def test_seed_none_follows_torch_manual_seed():
    x = torch.randn(50, 64)
    torch.manual_seed(123)
    a = quantize(x, 1)
    torch.manual_seed(123)
    b = quantize(x, 1)
    assert a.seed == b.seed and torch.equal(a.packed, b.packed)
    assert quantize(x, 1).seed != a.seed  # the generator advanced


# ---------------------------------------------------------------------------------------------
# strides and blocking
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_inputs_match_contiguous(dtype):
    base = torch.randn(60, 530).to(dtype)
    views = [
        base.t(),
        base[:, ::3],
        base[::2, 5:500],
        base.view(3, 20, 530).permute(2, 0, 1),
        base[0].expand(40, 530),
        base[:, 7],
    ]
    for v in views:
        assert not v.is_contiguous()
        a, b = quantize(v, 4, seed=5), quantize(v.contiguous(), 4, seed=5)
        assert torch.equal(a.packed, b.packed) and torch.equal(a.meta, b.meta)
        assert same_values(a.dequantize(), b.dequantize())


@pytest.mark.parametrize(
    "shape, group_size",
    [((1000, 7), 256), ((9, 781), 256), ((3, 5000), 256), ((2, 3000), 64), ((100,), 256)],
)
@pytest.mark.parametrize("chunk", [1, 100, 700, 5000])
def test_reference_blocking_does_not_change_results(shape, group_size, chunk):
    x = torch.randn(shape)
    x.view(-1)[17] = float("nan")
    ref = kq.quantize_reference(x, 2, group_size, 4)
    got = kq.quantize_reference(x, 2, group_size, 4, chunk_elems=chunk)
    assert torch.equal(ref[0], got[0])
    assert torch.equal(ref[1].view(torch.int16), got[1].view(torch.int16))
    y_ref = kq.dequantize_reference(*ref, 2, shape, x.dtype, group_size)
    y_got = kq.dequantize_reference(*ref, 2, shape, x.dtype, group_size, chunk_elems=chunk)
    assert same_values(y_ref, y_got)


def test_codes_follow_the_definition():
    """round_half_even(min(t + u - 1/2, 2**b - 1)), t = (x - lo_b) * fl(1 / scale_b), in fp32,
    with u from the element's offset in the group matrix."""
    x = torch.randn(9, 100)  # rows mode: k = 2, g = 200, last group has one padded row
    seed, bits = 11, 4
    q = quantize(x, bits, seed=seed)
    lay = q.layout
    lo_b, s = q.meta.float().unbind(1)
    codes = unpack_bits(q.packed, bits, lay.padded_numel).view(lay.num_groups, lay.group_size)
    xg = torch.cat([x, torch.zeros(1, 100)]).view(5, 200)
    u = uniform_reference(seed, torch.arange(lay.padded_numel)).view(5, 200)
    t = (xg - lo_b[:, None]) * (1.0 / s[:, None])
    want = (t + (u - 0.5)).clamp(max=15).round().to(torch.uint8)
    want[4, 100:] = 0  # padding
    assert torch.equal(codes, want)


# ---------------------------------------------------------------------------------------------
# statistics of stochastic rounding
# ---------------------------------------------------------------------------------------------


def test_unbiased_and_variance_bound():
    torch.manual_seed(0)
    x = torch.randn(24, 300) * 2 + 0.5  # two groups per row (g = 152, padded)
    bits, n = 2, 400
    total = torch.zeros_like(x, dtype=torch.float64)
    total_sq = torch.zeros_like(total)
    for seed in range(n):
        y = quantize(x, bits, seed=seed).dequantize().double()
        total += y
        total_sq += y * y
    mean = total / n
    var_emp = (total_sq / n - mean * mean).clamp_min(0)
    lo, scale = (t.double() for t in element_params(quantize(x, bits, seed=0)))
    frac = torch.frac((x.double() - lo) / scale)
    var = scale**2 * frac * (1 - frac)  # analytical variance of one sample
    se = (var / n).sqrt()

    # elementwise: within 5 standard errors (+ a skew allowance for f near 0 or 1)
    err = (mean - x.double()).abs()
    assert bool((err <= 5 * se + 4 * scale / n + 1e-6 * scale).all())
    # in aggregate the standardized errors look like N(0, 1): no systematic bias
    z = ((mean - x.double()) / se)[var > 0]
    assert abs(z.mean().item()) < 5 / math.sqrt(z.numel())
    assert 0.9 < z.std().item() < 1.1
    # variance: at most scale^2 / 4 (ActNN/GACT bound with the stored range), and on average
    # equal to the analytical one
    assert bool((var_emp <= scale**2 / 4 * (1 + 1e-9)).all())
    assert abs(var_emp.sum().item() / var.sum().item() - 1) < 0.05


# ---------------------------------------------------------------------------------------------
# more than 2^31 elements
# ---------------------------------------------------------------------------------------------


# Offsets past 2^31 are a known bug class (int32 index arithmetic in peers' kernels). The
# reference quantizer's offsets are Python ints except in two places, each tested here at such
# offsets without filling 2^31 elements: the RNG words of a range (computed in int32 pieces) and
# the cut into blocks. The full-size run (about 10 s and 3 GB on CPU) runs where a GPU is, and
# on CPU with GACT_GRAPH_FULL_SIZE=1.
BIG_ROWS, BIG_COLS = 509003, 4219  # 2**31 + 9 elements, 17 groups of 256 (248) per row


@pytest.mark.parametrize("start", [2**31 - 5, 2**32 - 3, 2**32 + 2**31 - 1, 2**40 - 2])
def test_rng_range_words_past_2_pow_31_match_the_int64_reference(start):
    from gact_graph.kernels.rng import uniform_bits_range_, uniform_bits_to_float

    h = uniform_bits_range_(torch.empty(4099, dtype=torch.int32), 7, start)
    offsets = torch.arange(start, start + 4099, dtype=torch.int64)
    assert torch.equal(uniform_bits_to_float(h), uniform_reference(7, offsets))


def test_blocks_cover_every_group_of_a_tensor_past_2_pow_31_once():
    layout = group_layout((BIG_ROWS, BIG_COLS), 256)
    assert layout.rows * layout.cols == 2**31 + 9
    assert (layout.groups_per_row, layout.group_size) == (17, 256)
    chunk = 1 << 20
    next_group, blocks = 0, 0
    for blk in kq._blocks(layout, chunk):
        assert blk.first == next_group  # in order, no gap, no overlap
        assert blk.count * layout.group_size <= chunk
        r0, c0 = divmod(blk.first, layout.groups_per_row)
        assert (blk.r0, blk.c0) == (r0, 0) and blk.r1 > blk.r0
        assert blk.count == (blk.r1 - blk.r0) * layout.groups_per_row
        next_group += blk.count
        blocks += 1
    assert next_group == layout.num_groups and blocks > 1
    assert (layout.num_groups - 1) * layout.group_size > 2**31  # the offsets did pass 2^31


def _full_size_devices():
    devices = [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else []
    if os.environ.get("GACT_GRAPH_FULL_SIZE") == "1":
        devices.append("cpu")
    return devices or [pytest.param("cpu", marks=pytest.mark.skip(reason=(
        "full size runs on a GPU or with GACT_GRAPH_FULL_SIZE=1; the two tests above cover "
        "the offsets past 2^31 cheaply")))]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("device", _full_size_devices())
def test_more_than_2_pow_31_elements(device):
    """fp16 (509003, 4219) = 2**31 + 9 elements, as an overlapping strided view of 513k
    values (x[r, c] = base[r + c]) so it costs 1 MB of input instead of 4.3 GB; the quantizer
    still processes every element and the packed output (277 MB at 1 bit) is real."""
    rows, cols, bits, seed = BIG_ROWS, BIG_COLS, 1, 99
    torch.manual_seed(0)
    base = (torch.randn(rows + cols - 1) * 3).half().to(device)
    x = base.as_strided((rows, cols), (1, 1))
    assert x.numel() == 2**31 + 9
    q = quantize(x, bits, seed=seed)
    lay = q.layout
    assert (lay.groups_per_row, lay.group_size) == (17, 256)
    assert q.shape == x.shape and q.numel() == 2**31 + 9
    assert q.nbytes == lay.num_groups * 256 * bits // 8 + lay.num_groups * 4
    assert q.nbytes == q.packed.numel() + 4 * q.meta.shape[0]

    bpg = 256 * bits // 8
    past_2_31 = 2**31 // 256 + 1  # first group whose offsets exceed 2^31
    for grp in [0, 1, 16, 17, past_2_31, past_2_31 + 16, lay.num_groups - 1]:
        r, j = divmod(grp, 17)
        vals = x[r, j * 256 : (j + 1) * 256].float().cpu()
        lo_b, s = q.meta[grp].float().tolist()
        assert lo_b <= vals.min().item() and lo_b + s >= vals.max().item()
        off = torch.arange(vals.numel()) + grp * 256
        want = ((vals - lo_b) / s + uniform_reference(seed, off)).floor().clamp(0, 1)
        got = unpack_bits(q.packed[grp * bpg : (grp + 1) * bpg].cpu(), bits, vals.numel())
        assert torch.equal(got, want.to(torch.uint8))


@pytest.mark.parametrize("bits", [2, 8])
def test_fp16_near_its_maximum_dequantizes_finite(bits):
    # without the clamp, 200/200 seeds at 2 bits (176/200 at 8) gave inf for max |x| = 65504
    torch.manual_seed(0)
    x = ((torch.rand(32, 256) * 2 - 1) * 65504).half()
    x[:, 0] = 65504
    x[7, 9] = float("nan")  # a non-finite group still comes back NaN
    for s in range(50):
        y = quantize(x, bits, seed=s).dequantize()
        assert torch.isnan(y[7]).all()
        finite = torch.cat([y[:7], y[8:]])
        assert torch.isfinite(finite).all() and finite.abs().max() <= 65504


@pytest.mark.parametrize("group_size", [2**13, 2**22])
def test_a_group_is_never_larger_than_the_tensor(group_size):
    # a (100, 64) tensor with G = 2^22 used to be one group padded to 4M elements: 41x the input
    x = torch.randn(100, 64)
    q = quantize(x, 2, group_size=group_size, seed=0)
    assert q.layout.num_groups == 1 and q.layout.group_size == 100 * 64
    assert q.nbytes == 100 * 64 * 2 // 8 + 4
    assert torch.equal(q.dequantize().isfinite(), torch.ones_like(x, dtype=torch.bool))


def test_float64_beyond_fp32_range_raises_instead_of_nan():
    x = torch.randn(300, 8, dtype=torch.float64)
    x[3, 1] = 1e300
    with pytest.raises(ValueError, match="beyond fp32's range"):
        quantize(x, 2)
    x[3, 1] = float("inf")  # non-finite is not a range problem: its group comes back NaN
    assert quantize(x, 2, seed=0).dequantize()[3].isnan().all()


@pytest.mark.parametrize("shape", [(256, 256), (64, 64), (300, 256)])
def test_non_contiguous_input_quantizes_like_its_contiguous_copy(shape):
    """A transposed square tensor made the reference's group matrix non-contiguous, and the
    random draws were viewed flat from a tensor with its strides (a crash under autocast,
    where F.linear saves a transposed bf16 weight)."""
    x = torch.randn(shape[::-1]).t()
    assert not x.is_contiguous()
    for bits in (2, 4):
        a = quantize(x, bits, group_size=256, seed=3).dequantize()
        b = quantize(x.contiguous(), bits, group_size=256, seed=3).dequantize()
        assert torch.equal(a, b)


def test_reference_temporaries_are_bounded_by_its_block(monkeypatch):
    """The reference's working memory is its block's (about 13 bytes per element: values,
    hash words and their scratch, codes), not the tensor's: on CPU it lands on the forward's
    widest moment. Counted as live tensor bytes beyond the outputs; a whole-tensor
    temporary (4 bytes x 2**21 elements here) would exceed the bound."""
    from gact_graph.budget.profile import LiveBytes
    from gact_graph.kernels import rng

    x = torch.randn(1 << 15, 64)  # 2**21 elements, 8 MiB
    # the per-device arange cache, as small as it gets (2**16): its slices are views of it,
    # so all of it is counted, whatever size earlier tests left it at
    monkeypatch.setattr(rng, "_ARANGE", {})
    kq.quantize_reference(x[:8], 1, 256, 0)
    chunk = 1 << 16
    with LiveBytes(exclude=[x]) as live:  # x's storage comes back through views
        packed, meta = kq.quantize_reference(x, 1, 256, 3, chunk_elems=chunk)
    outputs = packed.untyped_storage().nbytes() + meta.untyped_storage().nbytes()
    assert live.peak - outputs <= 16 * chunk + 4 * chunk  # block temporaries + arange growth
    ref = kq.quantize_reference(x, 1, 256, 3, chunk_elems=1 << 22)  # one block: same codes
    assert torch.equal(packed, ref[0])
    assert torch.equal(meta.view(torch.int16), ref[1].view(torch.int16))
