"""Integer codes packed into bytes along the channel axis, and back: the storage of ``formats.IntCodec`` and
``formats.ChannelCodec``, read the same way by the Triton decode (``triton_decode._load_rows``); and float8 bytes
read back as numbers (``formats.Fp8Codec``)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def pack(q: Tensor, bits: int) -> Tensor:
    """Codes [..., D] (values < 2^bits) packed along D into bytes: ``8 // bits`` planes of D*bits/8 channels
    each, plane i in bits i*bits.. of every byte (int3: a 2-bit pack of the low bits, then a 1-bit pack of the
    high bit)."""
    if bits == 3:
        return torch.cat([pack(q & 3, 2), pack(q >> 2, 1)], -1)
    if bits == 8:
        return q
    n = 8 // bits
    planes = q.unflatten(-1, (n, q.shape[-1] // n)).to(torch.int32)
    shifts = torch.arange(0, 8, bits, device=q.device, dtype=torch.int32)[:, None]
    return (planes << shifts).sum(-2).to(torch.uint8)


def unpack(codes: Tensor, bits: int) -> Tensor:
    """``pack``'s inverse: bytes [..., D*bits/8] -> codes [..., D] uint8."""
    if bits == 3:
        quarter = codes.shape[-1] * 2 // 3  # the 2-bit plane holds D/4 bytes, the 1-bit plane D/8
        return unpack(codes[..., :quarter], 2) | (unpack(codes[..., quarter:], 1) << 2)
    if bits == 8:
        return codes
    planes = [codes >> shift if shift + bits == 8 else (codes >> shift if shift else codes) & (2**bits - 1)
              for shift in range(0, 8, bits)]  # one plane per op: five times faster than one broadcast shift
    return torch.cat(planes, -1)


def fp8_values(codes: Tensor, dtype: torch.dtype) -> Tensor:
    """float8 codes as ``dtype`` through the table of all 256 (the cast of every byte: bit-exact), because CPU float8
    casts run one element at a time: the lookup takes half as long."""
    return fp8_table(codes.device, dtype).index_select(0, codes.view(torch.uint8).flatten().int()).view(codes.shape)


@functools.cache
def fp8_table(device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).view(torch.float8_e4m3fn).to(dtype)
