"""Every Triton kernel in `gact_graph.kernels` compiles for sm_90 (H100, H200) without a GPU, as
its launcher launches it: the quantizer and dequantizer (`gact_graph.kernels.quantize`, with the
RNG helpers of `gact_graph.kernels.rng` it calls), the mask packing (`mask_pack`), the content
hash (`content_hash`), `rng.uniform`, and the GAT / GATv2 edge kernels (`gat_edge`,
`gatv2_edge`) at each blocking their tuner can pick, with dense and coded features and every
switch both ways, and their dropout mask's kernel. `bitpack` and `layout` hold no kernel.

The CPU kernel tests run in Triton's interpreter, which checks neither types nor layouts, so a
kernel they pass may still be one the compiler refuses. Each case here runs the library's own
entry point (`quantize` / `QTensor.dequantize`, `pack_bool_mask`, the adjacency's content hash,
the edge stage's forward and backward) on CPU tensors with the kernels' launches recorded
(`tests.kernels.compiled`), and compiles each launch as the device would for those arguments:
signature, constexprs, specialization and options all come from what the launcher passes.

Compiling costs about a second a launch, so the cases are the combinations that reach distinct
code, not the whole product; `test_cases_cover_every_tile_shape_and_switch` checks that they
still reach every tile shape the tuner's candidates give and every switch of the kernels, so a
new candidate or branch in the launcher fails there until a case covers it. sm_80 (A100) gets
a few cases only (the device machines are H100 / H200): two of the quantizer's, the small
kernels, whose conversions of each dtype and 64-bit atomics depend on the architecture, and
each edge kernel with 16-bit features at its widest blocking.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
import torch

from gact_graph.core.quantize import SUPPORTED_BITS, pack_bool_mask, quantize
from gact_graph.kernels import content_hash as ch
from gact_graph.kernels import mask_pack as mp
from gact_graph.kernels import quantize as kq
from tests.kernels.compiled import (
    check_compiled,
    compile_launch,
    recorded_launches,
    toolchain_missing,
)
from tests.kernels.interpreted import HAS_TRITON, INTERPRETED

if HAS_TRITON:
    import triton
    import triton.language as tl

pytestmark = pytest.mark.skipif(
    INTERPRETED or not HAS_TRITON, reason="interpreted kernels (TRITON_INTERPRET=1) / no Triton"
)


#: the targets compiled for (compute capability), as pytest ids
HOPPER, AMPERE = 90, 80
ARCHS = pytest.mark.parametrize("capability", [HOPPER, AMPERE], ids=lambda c: f"sm{c}")


def quant_kernels() -> tuple:
    return kq._quantize_pack_kernel, kq._unpack_dequantize_kernel


FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}  # fmt: skip


def compile_all(launches, capability: int = 90) -> None:
    """Compile every recorded launch for ``sm_<capability>`` (skip where nothing can be)."""
    missing = toolchain_missing(capability)
    if missing:
        pytest.skip(missing)
    assert launches, "the launcher launched nothing"
    for launch in launches:
        check_compiled(launch, capability)


# ---------------------------------------------------------------------------- quantizer
#: streaming multiprocessors of the device emulated (H100 / H200 SXM): the launcher makes its
#: programs smaller where a tensor has too few groups to give each SM two programs
SMS = 132
#: rows of 256 that leave every candidate its full programs on that device
BIG = 2 * SMS * 8192 // 256


class QCase(NamedTuple):
    """One quantize + dequantize round trip: ``shape`` (``t``: the transpose of a tensor of
    that shape, a strided view), dtype, bits, the tuner candidate forced (None: the untuned
    defaults, what runs before tuning and with ``GACT_GRAPH_AUTOTUNE=0``), and the switches
    it must reach."""

    shape: tuple
    dtype: str
    bits: int
    config: int | None = None
    t: bool = False
    wide: bool = False
    expect: tuple = ()  # (name, value) pairs some launch's constexprs must hold

    @property
    def id(self) -> str:
        cfg = "default" if self.config is None else f"cfg{self.config}"
        shape = "x".join(map(str, self.shape)) + (".T" if self.t else "")
        return f"{shape}-{self.dtype}-{self.bits}b-{cfg}{'-wide' if self.wide else ''}"


def _tile(config, dtype: str, bits: int, group: int = 256) -> tuple:
    """The tile ``(H, T, V, GROUPS, warps)`` of ``config`` for a tensor with many groups."""
    h, t, v = kq.tile_shape(group, bits, FLOATS[dtype].itemsize, config.threads, config.run)
    return h, t, v, max(1, config.elems // triton.next_power_of_2(group)), config.warps


def _quant_cases() -> list[QCase]:
    """Dense 256-wide rows (groups of 256, the common layout) at every bit width in fp32 and
    bf16, and at 1 and 8 bits in fp16 (the dtype changes the vector width and the loads and
    stores, the bits the packing: fp16 shares bf16's widths), under the untuned defaults.
    Then each tuner candidate forced, in fp32 at a bit width that rotates, and again in the
    first (dtype, bits) that gives either kernel a tile shape no case reached yet (the vector
    width follows the element size and the codes per byte). Then each layout switch once: rows
    split with the last group padded, whole rows per group (padded, not dense), a dense tensor
    whose last group ends early (its own one-group launch), a strided view (a transpose, read
    in place), a tensor of 5 elements (one 8-element group, one group per program), fp64
    input, and 64-bit RNG offsets (``WIDE``)."""
    if not HAS_TRITON or INTERPRETED:
        return []
    big = (BIG, 256)
    cases = [QCase(big, d, b) for d in ("fp32", "bf16") for b in SUPPORTED_BITS]
    cases += [QCase(big, "fp16", 1), QCase(big, "fp16", 8)]
    reached = {kind: {_tile(kq.DEFAULTS[kind], c.dtype, c.bits) for c in cases}
               for kind in kq.DEFAULTS}  # fmt: skip

    def add(pair, config):
        cases.append(QCase(big, *pair, config=config))
        for r in reached.values():
            r.add(_tile(kq.CONFIGS[config], *pair))

    for i, cfg in enumerate(kq.CONFIGS):
        add(("fp32", SUPPORTED_BITS[i % len(SUPPORTED_BITS)]), i)
        for pair in itertools.product(("fp32", "bf16", "fp64"), SUPPORTED_BITS):
            if any(_tile(cfg, *pair) not in r for r in reached.values()):
                add(pair, i)
                break
    split = (("SPLIT", True), ("DENSE", False))
    cases += [
        QCase((33, 300), "fp32", 2, expect=split),
        QCase((700, 13), "bf16", 4, expect=(("SPLIT", False), ("DENSE", False))),
        QCase((700, 16), "fp16", 8, expect=(("PARTIAL", True), ("GROUPS", 1))),
        QCase((300, 11), "fp32", 1, t=True, expect=split),
        QCase((5,), "fp32", 2, expect=(("G", 8), ("GROUPS", 1))),
        QCase(big, "fp64", 4),
        QCase(big, "fp32", 2, wide=True, expect=(("WIDE", True),)),
    ]
    return cases


QUANT_CASES = _quant_cases()


def record_quant(case: QCase, monkeypatch) -> list:
    """The launches of quantizing a tensor of ``case`` and dequantizing it again, as the
    launcher makes them on a CUDA device with `SMS` SMs before it tunes."""
    monkeypatch.setenv("GACT_GRAPH_FORCE_TRITON", "1")  # the Triton path on CPU tensors
    if case.wide:
        monkeypatch.setattr(kq, "WIDE_FROM", 0)
    launch = kq._launch

    def on_device(kind, bits, layout, element_size, device, dense, run):
        launch(kind, bits, layout, element_size, torch.device("cuda"), dense, run)

    monkeypatch.setattr(kq, "_launch", on_device)
    monkeypatch.setattr(kq, "_sm_count", lambda device: SMS)
    monkeypatch.setattr(kq, "_autotune_enabled", lambda device: False)
    x = torch.zeros(case.shape, dtype=FLOATS[case.dtype])
    x = x.t() if case.t else x
    forced = kq.forced_config(kq.CONFIGS[case.config]) if case.config is not None else None
    with recorded_launches(*quant_kernels()) as launches:
        if forced is None:
            quantize(x, case.bits, 256, seed=1).dequantize()
        else:
            with forced:
                quantize(x, case.bits, 256, seed=1).dequantize()
    return launches


def _quant_targets() -> list:
    """Every case for sm_90; for sm_80 two with the default configuration: fp32 at 1 bit (its
    layout change through shared memory) and bf16 at 2 bits."""
    out = [pytest.param(c, HOPPER, id=f"sm90-{c.id}") for c in QUANT_CASES]
    ampere = [QCase((BIG, 256), "fp32", 1), QCase((BIG, 256), "bf16", 2)]
    return out + [pytest.param(c, AMPERE, id=f"sm80-{c.id}") for c in ampere if QUANT_CASES]


@pytest.mark.parametrize("case, capability", _quant_targets())
def test_quantizer_compiles(case, capability, monkeypatch):
    launches = record_quant(case, monkeypatch)
    kinds = {launch.kernel for launch in launches}
    assert kinds == set(quant_kernels()), "quantize and dequantize each launch"
    for name, value in case.expect:
        assert any(la.constexprs()[name] == value for la in launches), (name, value)
    if case.config is not None:
        cfg = kq.CONFIGS[case.config]
        assert all(la.kwargs["num_warps"] == cfg.warps for la in launches)
    compile_all(launches, capability)


@pytest.mark.parametrize("shape, first", [((BIG, 256), 1), ((700, 13), 19)],
                         ids=["256-wide", "19-rows-per-group"])  # fmt: skip
def test_row_range_dequantizes_compile(shape, first, monkeypatch):
    """`QTensor.rows` (BatchNorm's and GAT's backward read saved tensors by row ranges) hands
    the dequantizer codes and metadata that start past the first group: pointers aligned to
    4 bytes only (the metadata; the codes too with 62-byte groups), so Triton specializes
    them otherwise than the whole tensor's (2 bits, bf16)."""
    x = torch.zeros(shape, dtype=torch.bfloat16)
    q = quantize(x, 2, 256, seed=0)  # the CPU reference: only the dequantize is recorded
    part = q.rows(first, shape[0] - first)
    monkeypatch.setenv("GACT_GRAPH_FORCE_TRITON", "1")
    with recorded_launches(kq._unpack_dequantize_kernel) as launches:
        part.dequantize()
    assert part.meta.data_ptr() % 16 != 0
    compile_all(launches)


def test_cases_cover_every_tile_shape_and_switch(monkeypatch):
    """What the cases above reach (recorded, nothing compiled): every bit width in both
    kernels, every tile shape (``H, T, V, GROUPS``, warps) the tuner's candidates give dense
    256-wide groups of every input dtype, and both values of every switch."""
    seen: dict[str, set] = {"tile": set(), "bits": set(), "switch": set(), "out": set()}
    for case in QUANT_CASES:
        with monkeypatch.context() as m:
            launches = record_quant(case, m)
        for la in launches:
            c = la.constexprs()
            kind = la.kernel.__name__
            seen["bits"].add((kind, c["BITS"]))
            if c["G"] == 256:
                tile = (c["H"], c["T"], c["V"], c["GROUPS"], la.kwargs["num_warps"])
                seen["tile"].add((kind, tile))
            for name in ("DENSE", "PARTIAL", "SPLIT", "WIDE", "OUT_BF16", "OUT_FP16"):
                if name in c:
                    seen["switch"].add((kind, name, bool(c[name])))
    for kind in (k.__name__ for k in quant_kernels()):
        assert {(kind, b) for b in SUPPORTED_BITS} <= seen["bits"]
        for cfg, bits, size in itertools.product(kq.CONFIGS, SUPPORTED_BITS, (8, 4, 2)):
            h, t, v = kq.tile_shape(256, bits, size, cfg.threads, cfg.run)
            tile = (h, t, v, max(1, cfg.elems // 256), cfg.warps)
            assert (kind, tile) in seen["tile"], (kind, cfg, bits, size)
    switches = {("_quantize_pack_kernel", n) for n in ("DENSE", "PARTIAL", "SPLIT", "WIDE")}
    switches |= {("_unpack_dequantize_kernel", n)
                 for n in ("DENSE", "PARTIAL", "SPLIT", "OUT_BF16", "OUT_FP16")}  # fmt: skip
    for kind, name in switches:
        assert {(kind, name, False), (kind, name, True)} <= seen["switch"], (kind, name)


# ---------------------------------------------------------------------------- the others
@ARCHS
def test_mask_packing_compiles(capability, monkeypatch):
    """A 3-D mask (`pack_bool_mask` flattens it); one kernel, one block size."""
    monkeypatch.setenv("GACT_GRAPH_FORCE_TRITON", "1")
    with recorded_launches(mp._pack_mask_kernel) as launches:
        pack_bool_mask(torch.rand(3, 7, 11) > 0.5)
    compile_all(launches, capability)


@ARCHS
@pytest.mark.parametrize("dtype", ch.HASHABLE_DTYPES, ids=str)
def test_content_hash_compiles(dtype, capability, monkeypatch):
    """Every dtype the kernel reads (each its own load and widening to 64 bits), through the
    adjacency cache's hash of a tensor, with the cache's multipliers."""
    from gact_graph.sparse import content_hash as hashing

    monkeypatch.setenv("GACT_GRAPH_FORCE_TRITON", "1")
    t = torch.arange(5000).to(dtype)
    # the kernel counts as checked already: its first use would compare its (unrun) output
    monkeypatch.setattr(hashing, "_TRITON_HASH_TRUSTED", {(t.device, dtype): True})
    with recorded_launches(ch._hash_kernel) as launches:
        hashing.hash_pair(t)
    compile_all(launches, capability)


@ARCHS
@pytest.mark.parametrize("seed", [12345, 2**32 - 1], ids=["seed-i32", "seed-i64"])
def test_rng_uniform_compiles(seed, capability):
    """`rng.uniform` (a device function; no library kernel calls it) in the kernel that tests
    it, with a seed that fits int32 and one passed as int64."""
    from tests.kernels.test_kernels_quantize import _uniform_kernel

    offsets = torch.tensor([0, 1, 2**40 + 3], dtype=torch.int64)
    out = torch.empty(3, dtype=torch.float32)
    with recorded_launches(_uniform_kernel) as launches:
        _uniform_kernel[(1,)](offsets, out, seed, offsets.numel(), BLOCK=16)
    compile_all(launches, capability)


# ---------------------------------------------------------------------------- GAT blockings
#: the edge-stage kernels a GAT / GATv2 layer's forward and backward launch
GAT_KERNELS = ("_gat_edge_fwd_kernel", "_gat_edge_bwd_dst_kernel", "_gat_edge_bwd_src_kernel",
               "_gatv2_edge_fwd_kernel", "_gatv2_edge_bwd_dst_kernel",
               "_gatv2_edge_bwd_src_kernel")  # fmt: skip


def gat_kernel(name: str):
    """The GAT (`gat_edge`) or GATv2 (`gatv2_edge`) kernel ``name`` of `GAT_KERNELS`."""
    from gact_graph.kernels import gat_edge, gatv2_edge

    return getattr(gatv2_edge if name.startswith("_gatv2") else gat_edge, name)


#: switches of the layer's calls, in turn per kernel: everything on; dropout off, no
#: destination logits (``a_dst`` None), the transpose in CSR order (no ``t_pos``) and only some
#: gradients needed; others needed. ``needs`` as each backward takes it (GAT: x, a_src, a_dst;
#: GATv2: x_l, x_r, att).
GAT_VARIANTS = (
    dict(dropout=0.1, dst=True, pos=True, gat_needs=(True, True, True),
         v2_needs=(True, True, True)),
    dict(dropout=0.0, dst=False, pos=False, gat_needs=(False, True, False),
         v2_needs=(True, False, False)),
    dict(dropout=0.1, dst=True, pos=True, gat_needs=(True, False, True),
         v2_needs=(True, False, True)),
)  # fmt: skip


def _gat_cases() -> list:
    """Each edge kernel compiles as its launcher launches it, with dense fp32 features, dense
    16-bit ones (bf16 and fp16 in turn: the launcher passes the features as the unused
    metadata pointer too), and, where it reads them, 2-bit codes (`CodedFeatures`, of bf16 or
    fp16 features in turn), each with the next of `GAT_VARIANTS` (so every switch compiles
    both ways: `test_gat_cases_cover_every_switch`); widths of 256 and 40 channels (not a
    power of two) in turn. On a GPU the first step times up to four blockings per kernel, and
    a compile error there (unlike a kernel too large for the device) is not caught: the cases
    take every blocking the tuner can pick for some degree bucket in turn, each at least
    twice."""
    if not HAS_TRITON or INTERPRETED:
        return []
    from gact_graph.kernels import gat_rows

    blockings = sorted({c for i in range(11) for c in gat_rows._candidates(1 << i)})
    cases = []
    for k, name in enumerate(GAT_KERNELS):
        reads_codes = any(p.name.endswith("_BITS") for p in gat_kernel(name).params)
        half = ("bf16", "fp16")[k % 2]
        channels = (256, 40)[k % 2]
        forms = ("fp32", half, f"{half}-codes") if reads_codes else ("fp32", half)
        for variant, form in enumerate(forms):
            blocking = blockings[len(cases) % len(blockings)]
            case_id = f"{name}-{form}-{channels}-{blocking}-v{variant}"
            cases.append(pytest.param(name, blocking, channels, form, variant, id=case_id))
    return cases


GAT_CASES = _gat_cases()


def record_gat(name, blocking, channels, form, variant) -> list:
    """The launches of ``name`` in a GAT / GATv2 edge stage's forward and backward on a small
    graph with one high-degree row, as the layer calls them (`GAT_VARIANTS`)."""
    from gact_graph.kernels import gat_edge as ge
    from gact_graph.kernels import gat_rows as gr
    from gact_graph.kernels import gatv2_edge as ge2
    from tests.kernels.test_gat_edge import graph

    v = GAT_VARIANTS[variant]
    rowptr, col, n = graph("huge_row")
    heads, dt = 2, FLOATS[form.split("-")[0]]
    x, x_r, out = (torch.zeros(n, heads, channels, dtype=dt) for _ in range(3))
    if form.endswith("-codes"):  # how the layer hands the kernels its saved features
        q = quantize(x.reshape(n * heads, channels), 2, seed=0)
        x = gr.coded_features(q.packed, q.meta, q.bits, q.layout, q.dtype, heads)
        q = quantize(x_r.reshape(n * heads, channels), 2, seed=1)
        x_r = gr.coded_features(q.packed, q.meta, q.bits, q.layout, q.dtype, heads)
    a, m, s = (torch.zeros(n, heads) for _ in range(3))
    a_dst = a if v["dst"] else None
    att = torch.zeros(heads, channels, dtype=dt)
    t_rowptr, t_col, t_pos = gr.csr_transpose(rowptr, col, n)
    t_pos = t_pos if v["pos"] else None
    seed = torch.zeros(1, dtype=torch.int64) if v["dropout"] else None
    drop = dict(dropout=v["dropout"], seed=seed, config=blocking)
    coded = isinstance(x, gr.CodedFeatures)
    transpose = (t_rowptr, t_col, t_pos, m, s)
    with recorded_launches(*map(gat_kernel, GAT_KERNELS)) as launches:
        if "gatv2" in name:
            ge2.gatv2_edge_forward(x, x_r, att, rowptr, col, stats_only=coded, **drop)
            ge2.gatv2_edge_backward(out, x, x_r, att, rowptr, col, *transpose,
                                    needs=v["v2_needs"], **drop)  # fmt: skip
        else:
            if not coded:  # its forward reads the dense features only
                ge.gat_edge_forward(x, a, a_dst, rowptr, col, **drop)
            ge.gat_edge_backward(out, x, a, a_dst, rowptr, col, *transpose,
                                 needs=v["gat_needs"], **drop)  # fmt: skip
    launches = [la for la in launches if la.kernel is gat_kernel(name)]
    assert launches, f"{name} was not launched"
    for la in launches:
        assert la.kwargs["num_warps"] == blocking[2] and la.constexprs()["BLOCK_E"] == blocking[0]
        bits = [v for k, v in la.constexprs().items() if k.endswith("_BITS")]
        assert all(b == (2 if coded else 0) for b in bits), la.constexprs()
    return launches


@pytest.mark.parametrize("name, blocking, channels, form, variant", GAT_CASES)
def test_gat_edge_blockings_compile_for_hopper(name, blocking, channels, form, variant):
    compile_all(record_gat(name, blocking, channels, form, variant), HOPPER)


def _gat_ampere_cases() -> list:
    """Each edge kernel for sm_80 (A100) with 16-bit features, where that architecture's
    conversions differ from sm_90's: dense bf16, and 2-bit codes of fp16 features where the
    kernel reads codes (dense fp16 otherwise), everything switched on, 256 channels, and the
    widest edge block the tuner can pick (the largest tile of features a program holds)."""
    if not HAS_TRITON or INTERPRETED:
        return []
    from gact_graph.kernels import gat_rows

    widest = max({c for i in range(11) for c in gat_rows._candidates(1 << i)})  # most edges a block
    cases = []
    for name in GAT_KERNELS:
        reads_codes = any(p.name.endswith("_BITS") for p in gat_kernel(name).params)
        for form in ("bf16", "fp16-codes" if reads_codes else "fp16"):
            case_id = f"{name}-{form}-256-{widest}"
            cases.append(pytest.param(name, widest, 256, form, 0, id=case_id))
    return cases


@pytest.mark.parametrize("name, blocking, channels, form, variant", _gat_ampere_cases())
def test_gat_edge_compiles_for_ampere(name, blocking, channels, form, variant):
    compile_all(record_gat(name, blocking, channels, form, variant), AMPERE)


def test_gat_cases_cover_every_switch():
    """Each GAT / GATv2 kernel's boolean switches take both values over the cases above
    (recorded, nothing compiled)."""
    seen: dict[str, set] = {}
    for case in GAT_CASES:
        for la in record_gat(*case.values):
            flags = {(k, v) for k, v in la.constexprs().items() if isinstance(v, bool)}
            seen.setdefault(la.kernel.__name__, set()).update(flags)
    assert set(seen) == set(GAT_KERNELS)
    for kernel, flags in seen.items():
        for name in {k for k, _ in flags}:
            assert {(name, False), (name, True)} <= flags, (kernel, name)


def test_gat_dropout_keep_mask_compiles_for_hopper():
    """The kernel that materializes the edge kernels' dropout mask (tests and debugging)."""
    from gact_graph.kernels import gat_edge as ge

    with recorded_launches(ge._gat_edge_keep_kernel) as launches:
        ge.gat_edge_dropout_keep(torch.zeros(1, dtype=torch.int64), 300, 3, 0.1)
    compile_all(launches, HOPPER)


# ---------------------------------------------------------------------------- the harness
def _half(v):  # a plain Python function: the interpreter calls it, the compiler cannot
    return v * 0.5


if HAS_TRITON and not INTERPRETED:

    @triton.jit
    def _calls_python(x_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, _half(tl.load(x_ptr + i)))


def test_a_kernel_the_compiler_refuses_fails_here():
    """The compile step is no formality: a kernel that Triton's interpreter runs (it calls a
    plain Python function) is refused here, and a launch records its arguments untouched."""
    missing = toolchain_missing(HOPPER)
    if missing:
        pytest.skip(missing)
    x, out = torch.ones(16), torch.zeros(16)
    with recorded_launches(_calls_python) as launches:
        _calls_python[(1,)](x, out, BLOCK=16)
    (launch,) = launches
    assert launch.args[:2] == (x, out) and launch.constexprs() == {"BLOCK": 16}
    assert torch.equal(out, torch.zeros(16)), "a recorded launch runs nothing"
    with pytest.raises(Exception, match="Unsupported function"):
        compile_launch(launch, HOPPER)
