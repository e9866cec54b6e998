"""Quantized storage of a compressed cache's entries: KIVI, and transformers' quanto / HQQ backends.

`KVQuant` says how the entries a method keeps are stored; `CompressedCache(..., kv_quant=q)` applies
it to every compressible layer (`CompressibleLayer.quantize_residual`). The prefill's attention is
full precision in KIVI and in transformers' `QuantizedCache` alike; `order` says when the method
scores:

- `score_then_quantize`: the prompt is scored and pruned at full precision, then the kept entries
  are quantized as the prefill ends; a later pruning (decode-time eviction, decode schedules) is
  refused.
- `dequant_prune_requant`: kvpress' order on transformers' `QuantizedCache` (its presses read the
  cache's dequantized keys and values, prune, and quantize what they keep again): the prompt is
  stored quantized when the prefill ends (`CompressibleLayer.before_compress`), the method scores
  the values read back, and every pruning (the prompt's, and any while decoding) has the kept
  entries quantized again by the prompt's rule.

Storage (`packed`, on by default): the quantized entries are held packed, as the original holds
them: integer codes in uint8 (`pack_codes`: four 2-bit, two 4-bit or one 8-bit code per byte), a
scale and a zero point per group in the cache's dtype (`KiviPack`; quanto / hqq: the backend's own
quantized tensors, `BackendPack`), and the full-precision residual after them as the layer's
tensors. Reading the layer (`CompressibleLayer.keys` / `values`, what each forward's attention is
given) dequantizes the packs and appends the residual: one layer's full-precision K/V exists only
during its attention, so the process memory is the packed bytes (KIVI's fused kernels read the
codes directly; here the read-back costs time on every forward). `kv_bytes` is the bytes of the
tensors stored (`CompressibleLayer.stored_bytes`). Every method, checkpoint and rollback sees the
values read back: an in-place pruning (decode-time eviction under dequant_prune_requant) unpacks the
layer first and its kept entries are quantized again, as with `packed=False`, the reference storage
that holds the quantized entries as the values read back at the cache's dtype (the same tokens and
the same values attention reads, tests/test_kv_quant_packed.py; its `kv_bytes` is the same count,
computed from the layout, not the bytes it holds).

KIVI ([arXiv 2402.02750](https://arxiv.org/abs/2402.02750)), transcribed from
github.com/jy-yuan/KIVI at 876b4d2d08e3b1d5f70d0969c299d8c7c42ddfb6 (`quant/new_pack.py`,
`models/llama_kivi.py`):

- keys per channel, grouped along tokens: each run of `group_size` consecutive stored entries
  gets, per channel, its own min and scale (`triton_quantize_and_pack_along_last_dim` on the
  transposed keys `[batch, kv_heads, head_dim, tokens]`);
- values per token, grouped along channels: `group_size` consecutive channels of one entry share
  a min and a scale (the same function on `[batch, kv_heads, tokens, head_dim]`); `head_dim` must
  be a multiple of `group_size`;
- asymmetric round-to-nearest: `scale = (max - min) / (2^bits - 1)`, `code = round(clamp((x - min)
  / scale, 0, 2^bits - 1))`, read back as `code * scale + min`; codes packed into int32 (here into
  uint8: the same bytes), scale and min in the cache's dtype;
- the residual (`residual_length`, a multiple of `group_size`): the prompt's keys are quantized
  but for the last `len % residual` (all of them when that is 0), its values but for the last
  `residual`; while decoding, new entries join the residual at full precision; the keys' residual
  is quantized whole when it holds `residual` entries, the oldest value is quantized when the
  values' residual exceeds `residual`. The original quantizes right after the step's attention;
  here the pending flush runs before the next forward reads the cache (or at `checkpoint()` /
  `kv_bytes()`), which no attention can tell apart.
- deviation: a group whose values are all equal has scale 0; the original divides by it (NaN
  codes), here its codes are 0, read back as the exact value.

- computed in the cache's dtype (the original reads codes back in fp16: the same on fp16 models).

quanto / hqq: transformers' own `QuantoQuantizedLayer` / `HQQQuantizedLayer` quantize and
dequantize (`axis_key` / `axis_value` at the layers' defaults, as `QuantizedCache` leaves them);
their residual rule is transformers' `QuantizedLayer`: the whole prompt quantized after the
prefill, new entries kept at full precision, and once the residual reaches `residual`, all entries
(the dequantized ones and the residual) quantized again as one tensor.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import torch

KINDS = ("kivi", "quanto", "hqq")
ORDERS = ("score_then_quantize", "dequant_prune_requant")
# The bit widths each backend stores (KIVI packs 32 / bits codes per int32; transformers' checks).
BITS = {"kivi": (2, 4, 8), "quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """How the kept entries are stored. `kind`: kivi | quanto | hqq; `bits`: bits per code;
    `group_size`: entries (KIVI keys) or channels (KIVI values; quanto / hqq: their own grouping)
    sharing one scale and zero point; `residual`: the most recent entries kept at full precision
    (KIVI's `residual_length`, transformers' `residual_length`); `order`: score_then_quantize
    (methods score the full-precision prompt; the kept entries are quantized) or
    dequant_prune_requant (methods score the quantized prompt read back; what they keep is
    quantized again after each pruning)."""

    kind: str = "kivi"
    bits: int = 4
    group_size: int = 32
    residual: int = 128
    order: str = "score_then_quantize"
    # True: the quantized entries are stored packed (`KiviPack` / `BackendPack`) and dequantized when
    # attention reads the layer; False: stored as the values read back, at the cache's dtype (the
    # reference the packed storage is tested against: same tokens, same values attention reads).
    packed: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kv_quant.kind must be one of {', '.join(KINDS)}, got kind={self.kind!r}")
        if self.bits not in BITS[self.kind]:
            raise ValueError(
                f"kv_quant.bits for {self.kind} must be one of {BITS[self.kind]}, got bits={self.bits!r}"
            )
        for name in ("group_size", "residual"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_quant.{name} must be a positive integer, got {name}={value!r}")
        if self.kind == "kivi" and self.residual % self.group_size:
            raise ValueError(
                "kv_quant.residual must be a multiple of group_size for kivi (its keys' residual is "
                f"quantized in whole groups), got residual={self.residual}, group_size={self.group_size}"
            )
        if self.order not in ORDERS:
            raise ValueError(f"kv_quant.order must be one of {', '.join(ORDERS)}, got order={self.order!r}")
        if not isinstance(self.packed, bool):
            raise ValueError(f"kv_quant.packed must be true or false, got packed={self.packed!r}")

    def to_dict(self) -> dict:
        """The fields (rows' `kv_quant`, part of the config hash); `packed` only when off: packing
        changes where the values live, not what attention reads, and configs keep their hash."""
        d = dataclasses.asdict(self)
        if self.packed:
            del d["packed"]
        return d

    def check_method(self, method) -> None:
        """ValueError naming the combination when `method` (a `snapkv.methods.Method`) cannot store
        its entries this way, before any model runs: per-head storage (Ada-KV and its relatives,
        KVzip: ragged heads fit no group along tokens), and any pruning after the prompt's (decode-
        time eviction, decode schedules) under score_then_quantize, which quantizes once the prompt
        is pruned (dequant_prune_requant re-quantizes after every pruning)."""
        name = getattr(method, "name", type(method).__name__)
        if not method.cache_layer(0, 1).evicts_after_compression:
            raise ValueError(
                f"kv_quant={self.kind} does not support per-head storage, which method={name} uses"
            )
        if method.decode_schedule.on and self.order == "score_then_quantize":
            raise ValueError(
                f"kv_quant={self.kind} order={self.order} quantizes once the prompt is pruned: "
                f"method={name} evicts while decoding (decode-time eviction or a decode schedule), "
                "which is not supported with it (order=dequant_prune_requant re-quantizes after each pruning)"
            )

    def check_available(self) -> None:
        """ValueError naming the package a backend needs when it is not installed (checked before
        a model loads; KIVI needs none)."""
        needs = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
        if self.kind not in needs:
            return
        module, package = needs[self.kind]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package (optimum) is missing
            found = False
        if not found:
            raise ValueError(
                f"kv_quant={self.kind} needs the package {package} (pip install {package}), which is not "
                "installed"
            )

    def backend(self, like: torch.Tensor):
        """transformers' quantized cache layer of `kind` (quanto / hqq), whose `_quantize` /
        `_dequantize` this storage calls; ValueError naming the package when it is missing."""
        from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

        cls = {"quanto": QuantoQuantizedLayer, "hqq": HQQQuantizedLayer}[self.kind]
        try:  # the axes left at the layer's defaults, as transformers' `QuantizedCache` leaves them
            layer = cls(
                nbits=self.bits,
                q_group_size=self.group_size,
                residual_length=self.residual,
            )
        except ImportError as e:
            package = {"quanto": "optimum-quanto", "hqq": "hqq"}[self.kind]
            raise ValueError(f"kv_quant.kind={self.kind} needs the package {package}: {e}") from e
        # HQQ reads the device and dtype off the layer's (residual) keys
        layer.keys = like.new_empty(0)
        return layer


def kivi_keys(keys: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """KIVI's key quantization read back: `[batch, kv_heads, n, head_dim]` (n a multiple of
    `group_size`) -> the same shape, each channel of each run of `group_size` entries quantized
    with its own min and scale."""
    b, h, n, d = keys.shape
    return _round_trip(keys.reshape(b, h, n // group_size, group_size, d), bits, dim=3).reshape(b, h, n, d)


def kivi_values(values: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """KIVI's value quantization read back: `[batch, kv_heads, n, head_dim]` -> the same shape,
    each entry's `group_size` consecutive channels quantized with their own min and scale."""
    b, h, n, d = values.shape
    _check_value_groups(d, group_size)
    return _round_trip(values.reshape(b, h, n, d // group_size, group_size), bits, dim=4).reshape(b, h, n, d)


def _check_value_groups(head_dim: int, group_size: int) -> None:
    if head_dim % group_size:
        raise ValueError(
            f"kivi quantizes values in groups of channels: head_dim must be a multiple of "
            f"kv_quant.group_size, got head_dim={head_dim}, group_size={group_size}"
        )


def _round_trip(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min/max round-to-nearest along `dim`, read back (KIVI's formulas)."""
    codes, scale, mn = _quantize(x, bits, dim)
    return codes * scale + mn


def _quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI's codes (integers held in `x`'s dtype), scale and min along `dim` (kept, size 1)."""
    top = 2**bits - 1
    mn = x.amin(dim=dim, keepdim=True)
    scale = (x.amax(dim=dim, keepdim=True) - mn) / top
    # a constant group (scale 0) gets codes 0 (the original's division gives NaN codes)
    codes = ((x - mn) / scale.masked_fill(scale == 0, 1)).clamp(0, top).round()
    return codes, scale, mn


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes `[..., d]` (each below 2^bits) -> uint8 `[..., ceil(d * bits / 8)]`, 8 // bits
    codes per byte, the first in the low bits (KIVI packs 32 // bits per int32 the same way)."""
    per = 8 // bits
    codes = codes.to(torch.uint8)
    if codes.shape[-1] % per:  # the last byte of each row half filled (zero codes)
        codes = torch.nn.functional.pad(codes, (0, -codes.shape[-1] % per))
    codes = codes.unflatten(-1, (-1, per))
    packed = codes[..., 0].clone()
    for i in range(1, per):
        packed |= codes[..., i] << (bits * i)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """`pack_codes` undone: uint8 `[..., ceil(d * bits / 8)]` -> uint8 codes `[..., d]`."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)  # [..., bytes, 8 // bits]
    return codes.flatten(-2)[..., :d]


@dataclasses.dataclass(frozen=True, eq=False)  # eq: tensors do not compare to one bool
class KiviPack:
    """KIVI's storage of the leading `length` quantized keys or values of a layer.

    `codes`: uint8 `[batch, kv_heads, length, ceil(head_dim * bits / 8)]` (`pack_codes`);
    `scale` / `zero` (the group's min), in the cache's dtype: keys `[batch, kv_heads, length //
    group_size, head_dim]` (per channel, over each run of `group_size` entries), values `[batch,
    kv_heads, length, head_dim // group_size]` (per entry, over each run of `group_size` channels).
    Never changed in place (a flush builds a new one with `cat`): a checkpoint keeps it by reference.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    keys: bool
    bits: int
    head_dim: int

    @classmethod
    def quantize(cls, x: torch.Tensor, bits: int, group_size: int, keys: bool) -> KiviPack:
        """`x` `[batch, kv_heads, n, head_dim]` quantized as `kivi_keys` / `kivi_values` do (the
        same codes, scales and mins) and packed."""
        b, h, n, d = x.shape
        if keys:
            codes, scale, mn = _quantize(x.reshape(b, h, n // group_size, group_size, d), bits, dim=3)
            scale, mn = scale.squeeze(3), mn.squeeze(3)
        else:
            _check_value_groups(d, group_size)
            codes, scale, mn = _quantize(x.reshape(b, h, n, d // group_size, group_size), bits, dim=4)
            scale, mn = scale.squeeze(4), mn.squeeze(4)
        return cls(pack_codes(codes.reshape(b, h, n, d), bits), scale, mn, keys, bits, d)

    @property
    def length(self) -> int:
        return self.codes.shape[2]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.scale, self.zero

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def dequantize(self) -> torch.Tensor:
        """The values read back `[batch, kv_heads, length, head_dim]` (code x scale + min, in the
        cache's dtype: the same arithmetic as `kivi_keys` / `kivi_values`, so the same values)."""
        codes = unpack_codes(self.codes, self.bits, self.head_dim).to(self.scale.dtype)
        b, h, n, d = codes.shape
        if self.keys:
            g = n // self.scale.shape[2]
            out = codes.view(b, h, n // g, g, d) * self.scale.unsqueeze(3) + self.zero.unsqueeze(3)
        else:
            g = d // self.scale.shape[3]
            out = codes.view(b, h, n, d // g, g) * self.scale.unsqueeze(4) + self.zero.unsqueeze(4)
        return out.reshape(b, h, n, d)

    def cat(self, other: KiviPack) -> KiviPack:
        """This pack's entries followed by `other`'s (a new pack; keys: whole groups only)."""
        return self.rows(lambda a, b: torch.cat([a, b], dim=2), other)

    def rows(self, fn, other: KiviPack | None = None) -> KiviPack:
        """A new pack with `fn` applied to each tensor (and `other`'s, when given)."""
        pairs = zip(self.tensors(), other.tensors() if other is not None else [None] * 3)
        codes, scale, zero = (fn(a) if b is None else fn(a, b) for a, b in pairs)
        return dataclasses.replace(self, codes=codes, scale=scale, zero=zero)


@dataclasses.dataclass(frozen=True, eq=False)
class BackendPack:
    """quanto / hqq: transformers' quantized object `q` (codes, scales, zero points) of the leading
    `length` keys or values of a layer, read back by the backend's `_dequantize` at the cache's
    `dtype` (as a copy into the cache's tensors would cast it)."""

    backend: object
    q: object
    length: int
    dtype: torch.dtype

    def tensors(self) -> list[torch.Tensor]:
        return _tensors_of(self.q)

    @property
    def nbytes(self) -> int:
        return quantized_nbytes(self.q)

    def dequantize(self) -> torch.Tensor:
        return self.backend._dequantize(self.q).to(self.dtype)

    def rows(self, fn, other=None):
        raise ValueError(
            "batch re-indexing (beam search, repeated or selected rows) is not supported on packed "
            "quanto / hqq storage; use kv_quant.packed=false"
        )


def kivi_bytes(shape: tuple[int, int, int], keys: int, values: int, cfg: KVQuant, element_size: int) -> int:
    """Bytes of KIVI's storage of `keys` / `values` quantized entries of a layer with
    `shape` = (batch, kv_heads, head_dim): packed codes plus a scale and a min per group, in the
    cache's dtype (`element_size`)."""
    b, h, d = shape
    codes = math.ceil((keys + values) * b * h * d * cfg.bits / 8)
    groups = (keys // cfg.group_size) * b * h * d + values * b * h * (d // cfg.group_size)
    return codes + 2 * groups * element_size


def quantized_nbytes(q) -> int:
    """Bytes of the tensors a quanto / hqq quantized object holds (codes, scales, zero points)."""
    return sum(t.numel() * t.element_size() for t in _tensors_of(q))


def _tensors_of(q) -> list[torch.Tensor]:
    """The plain tensors a quanto / hqq quantized object holds (quanto's QTensor subclasses: their
    attributes; HQQ: a tensor and a dict of metadata)."""
    if isinstance(q, torch.Tensor) and type(q) is not torch.Tensor:
        return [t for v in vars(q).values() if isinstance(v, torch.Tensor) for t in _tensors_of(v)]
    if isinstance(q, torch.Tensor):
        return [q]
    if isinstance(q, dict | tuple | list):
        items = q.values() if isinstance(q, dict) else q
        return [t for v in items for t in _tensors_of(v)]
    return []
