import math

import pytest
import torch

from gact_graph.kernels.bitpack import (
    SUPPORTED_BITS,
    PackedMask,
    code_table,
    pack_bits,
    pack_mask,
    packed_nbytes,
    unpack_bits,
)
from tests.devices import DEVICES

SIZES = [0, 1, 3, 7, 8, 9, 255, 1023, 4097]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("numel", SIZES)
def test_pack_unpack_round_trip(device, bits, numel):
    gen = torch.Generator().manual_seed(numel * 10 + bits)
    codes = torch.randint(0, 1 << bits, (numel,), generator=gen, dtype=torch.uint8).to(device)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.device == codes.device
    assert packed.shape == (packed_nbytes(numel, bits),) == (math.ceil(numel * bits / 8),)
    assert torch.equal(unpack_bits(packed, bits, numel), codes)
    as_float = unpack_bits(packed, bits, numel, dtype=torch.float32)
    assert torch.equal(as_float, codes.float())


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_layout_is_little_endian_within_bytes(bits):
    numel = 37
    codes = torch.randint(0, 1 << bits, (numel,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes.to(torch.uint8), bits).tolist()
    expected = [0] * packed_nbytes(numel, bits)
    for i, c in enumerate(codes.tolist()):
        expected[i * bits // 8] |= c << ((i * bits) % 8)
    assert packed == expected


def test_pack_reads_any_shape_in_row_major_order():
    codes = torch.randint(0, 4, (6, 10), dtype=torch.uint8)
    assert torch.equal(pack_bits(codes.t(), 2), pack_bits(codes.t().contiguous().view(-1), 2))
    out = torch.empty(15, dtype=torch.uint8)
    assert pack_bits(codes, 2, out=out) is out
    assert torch.equal(out, pack_bits(codes.view(-1), 2))


def test_code_table_rows_are_the_codes_of_each_byte():
    table = code_table(2, torch.device("cpu"))
    assert table.shape == (256, 4)
    assert table[0b11_10_01_00].tolist() == [0, 1, 2, 3]


def test_pack_errors():
    with pytest.raises(ValueError, match=r"\(1, 2, 4, 8\)"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 3)
    with pytest.raises(TypeError):
        pack_bits(torch.zeros(8, dtype=torch.int32), 2)
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 2, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 4, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(), (0,), (13,), (3, 5, 7), (64,), (70001,)])
def test_mask_round_trip(device, shape):
    gen = torch.Generator().manual_seed(len(shape))
    mask = (torch.rand(shape, generator=gen) > 0.3).to(device)
    packed = pack_mask(mask)
    assert isinstance(packed, PackedMask)
    assert packed.nbytes == math.ceil(mask.numel() / 8) == packed.data.numel()
    out = packed.unpack()
    assert out.dtype == torch.bool and out.shape == mask.shape and out.device == mask.device
    assert out.is_contiguous()
    assert torch.equal(out, mask)


def test_mask_non_contiguous():
    mask = torch.rand(9, 17) > 0.5
    assert torch.equal(pack_mask(mask.t()).unpack(), mask.t())
    assert torch.equal(pack_mask(mask[:, ::3]).unpack(), mask[:, ::3])


def test_mask_rejects_non_bool():
    with pytest.raises(TypeError):
        pack_mask(torch.ones(4))
