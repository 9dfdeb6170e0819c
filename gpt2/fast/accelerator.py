"""The fast CPU path of one GPT2 model: all blocks, the final layer norm and
the LM head of a forward pass in C (csrc/), reading packed copies of the
weight matrices (`pack_rows`).

Legend: B = rows, T = new tokens per row, N = B * T, C = n_embd, V = vocab, L = n_layer.

`FastGPT2` sits at the model's seam, `GPT2.accelerator`. It takes every pass
it computes the same way as the readable path (CPU, float32, no gradient or
autocast, the stock modules without hooks, widths that are multiples of 8)
and returns None for the rest; a long pass (a prefill, a large tree) goes in
chunks. It owns its weight copies (float32, or int8 where the model was
quantised) and a table of pointers for blocks.c, and before every pass packs
again any parameter whose tensor, storage or version changed, so a copy never
goes stale (an edit through `.data` is the exception: `gpt2.fast.accelerate`).
A deep copy of the model gets its own; a pickle none.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
from torch.nn.modules import module as nn_module
from torch.optim.optimizer import register_optimizer_step_post_hook

from gpt2.kv_cache import KVCache
from gpt2.model import MLP, GPT2, Block, CausalSelfAttention

from .build import Kernels
from .quantize import dequantize_rows, quantize_rows_int8
from .threads import ThreadChooser

# Tokens per row in one kernel call: a verification pass, a token tree, a
# chunk of a longer pass. (Per-thread scores take T * (P + T) floats.)
MAX_NEW_TOKENS = 64
BLOCK_PARAMETERS = (  # per block, in BlockPointers order
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
)
MATRIX_SLOTS = (2, 4, 8, 10)  # the weight matrices among a block's BLOCK_PARAMETERS
# The class of each module of a block the kernels stand in for: the block, attn, mlp, then ln_1, c_attn, ... mlp.c_proj
BLOCK_KINDS = (Block, CausalSelfAttention, MLP, nn.LayerNorm, nn.Linear, nn.Linear, nn.LayerNorm, nn.Linear, nn.Linear)


class BlockPointers(ctypes.Structure):
    """One block's parameters as blocks.c reads them: layer norms as they are,
    weight matrices packed by `pack_rows` (float32, or int8 with their rows' scales;
    the scale is NULL for float32)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "ln_1_weight", "ln_1_bias",
            "c_attn", "c_attn_scale", "c_attn_bias",
            "attn_proj", "attn_proj_scale", "attn_proj_bias",
            "ln_2_weight", "ln_2_bias",
            "c_fc", "c_fc_scale", "c_fc_bias",
            "mlp_proj", "mlp_proj_scale", "mlp_proj_bias",
        )
    ]


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """W (out, in) in the kernel's layout: rows in groups of four, interleaved
    in blocks of 8 values, out padded to a multiple of 4 with zero rows. Any
    dtype.

    Returns:
        (ceil(out / 4), in / 8, 4, 8), contiguous, in W's dtype.
    """
    out_features, in_features = weight.shape
    w = weight.detach()
    if out_features % 4:
        w = torch.cat([w, w.new_zeros(4 - out_features % 4, in_features)])  # (4 ceil(out / 4), in)
    groups = w.reshape(-1, 4, in_features // 8, 8)  # (out / 4, 4, in / 8, 8)
    return groups.transpose(1, 2).contiguous()  # (out / 4, in / 8, 4, 8)


def stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """What identifies a tensor's current contents: its storage address and
    its version counter (moved by every in-place write)."""
    return tensor.data_ptr(), tensor._version


@dataclass(frozen=True)
class PackedWeight:
    """The kernels' copy of a weight W (out, in): W packed by `pack_rows` in
    float32, or its int8 levels q packed so, with W = scale[:, None] * q."""

    data: torch.Tensor  # (ceil(out / 4), in / 8, 4, 8), float32 or int8
    scale: torch.Tensor | None  # (out,) float32 with int8 data, else None
    source: tuple[int, int]  # `stamp` of W when this copy was made
    # W's storage, held: were it freed (`p.data = new`), a new tensor could take its address and version, and
    # this copy would look current
    held: torch.Tensor

    @property
    def pointers(self) -> tuple[int, int | None]:
        return self.data.data_ptr(), None if self.scale is None else self.scale.data_ptr()


def packed_copy(w: torch.Tensor, int8: bool) -> PackedWeight:
    """W (out, in) packed for the kernels: as its int8 levels where the model
    is int8 and W is exactly its rows' int8 rounding (a quantised weight copied
    or loaded again: rounding it again gives the same levels), else as float32."""
    if int8:
        q, scale = quantize_rows_int8(w)
        if torch.equal(dequantize_rows(q, scale), w):
            return PackedWeight(pack_rows(q), scale.contiguous(), stamp(w), w.detach())
    return PackedWeight(pack_rows(w), None, stamp(w), w.detach())


def plain_cpu(tensor: torch.Tensor) -> bool:
    """A plain tensor (or parameter) on the CPU, whose data pointer the kernels can read. A subclass may have no
    storage of its own (a wrapper such as a quantised weight: its data pointer is 0)."""
    return type(tensor) in (torch.Tensor, nn.Parameter) and tensor.is_cpu


def kernel_readable(tensor: torch.Tensor) -> bool:
    """A weight the kernels can read: plain, CPU float32, contiguous."""
    return plain_cpu(tensor) and tensor.dtype == torch.float32 and tensor.is_contiguous()


def cache_readable(buffer: torch.Tensor) -> bool:
    """A KV cache buffer (L, B, nh, S, hs) the kernels can read: CPU float32
    with each position's hs values contiguous. Layers, rows and heads may
    have any strides (a batch that `KVCache.keep_rows` shrank is a view)."""
    is_float32 = plain_cpu(buffer) and buffer.dtype == torch.float32
    return is_float32 and buffer.stride(4) == 1 and buffer.stride(3) == buffer.size(4)


class FastGPT2:
    """The C forward pass of one model (see the module docstring). Besides the
    seam's methods (`run_blocks`, `head`), callers may read:
        model     a weak reference to the model it runs
        kernels   the loaded C library (`kernels.path`: its file)
        int8      whether int8 was asked for (`weights`: what is packed)
        threads   the ThreadChooser, or None: always torch.get_num_threads()
        packed    name -> PackedWeight: the kernels' copy of each matrix they read
        takes(model, x, cache, mask), block_table(model): whether a pass runs
                  here, and the parameter table it would read."""

    def __init__(
        self, model: GPT2, kernels: Kernels, int8_levels: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        adapt_threads: bool = True,
    ) -> None:
        self.model = weakref.ref(model)  # the model owns this object, not the other way round
        self.kernels = kernels
        self.threads = ThreadChooser() if adapt_threads else None  # None: always torch.get_num_threads()
        self.int8 = bool(int8_levels)
        config = model.config
        self.names = [f"h.{i}.{p}" for i in range(config.n_layer) for p in BLOCK_PARAMETERS]  # L * 12
        self.matrix_names = [self.names[12 * i + s] for i in range(config.n_layer) for s in MATRIX_SLOTS]
        self.matrix_names.append("wte.weight")  # the tied LM head
        C, V = config.n_embd, config.vocab_size  # the sizes blocks.c reads: every parameter's shape, in order
        block = [(C,), (C,), (3 * C, C), (3 * C,), (C, C), (C,), (C,), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,)]
        self.shapes = [torch.Size(shape) for shape in block * config.n_layer + [(C,), (C,), (V, C)]]
        own_ordinary_tensors(model)
        weights = dict(model.named_parameters())
        self.packed: dict[str, PackedWeight] = {}
        with torch.no_grad():
            for name in self.matrix_names:
                w = weights.get(name)  # None: a block or parameter taken out of the model
                if w is None or not kernel_readable(w) or w.size(1) % 8:
                    continue  # the table check sends every pass to the readable path
                if int8_levels and name in int8_levels:
                    q, scale = int8_levels[name]
                    self.packed[name] = PackedWeight(pack_rows(q), scale.contiguous(), stamp(w), w.detach())
                else:
                    self.packed[name] = packed_copy(w, int8=False)
        self.table: ctypes.Array | None = None
        self.table_key: list | None = None  # the parameters' stamps when the table was built
        self.table_tensors: list[torch.Tensor] = []  # keeps the storage the table points into alive
        self.watch_optimizers()

    def watch_optimizers(self) -> None:
        """Packs every weight again after a step of an optimizer of the model's parameters: a fused one
        (`fused=True`) writes them without moving their version counters. (A hook of this object's own,
        removed when it goes.)"""
        self.optimizer_stepped = False
        this = weakref.ref(self)

        def stepped(optimizer, args, kwargs) -> None:
            fast = this()
            model = None if fast is None else fast.model()
            if model is not None and not fast.optimizer_stepped:
                mine = {id(p) for p in model.parameters()}
                fast.optimizer_stepped = any(id(p) in mine for group in optimizer.param_groups for p in group["params"])

        weakref.finalize(self, register_optimizer_step_post_hook(stepped).remove)

    @property
    def weights(self) -> str:
        """What the kernels read: "int8", "float32", or "int8 and float32" once some quantised weights were
        replaced by others (each is packed as it is; before the first pass, as `accelerate` was asked)."""
        kinds = {"float32" if p.scale is None else "int8" for p in self.packed.values()}
        return " and ".join(sorted(kinds, reverse=True)) if kinds else "int8" if self.int8 else "float32"

    def __deepcopy__(self, memo: dict) -> FastGPT2 | None:
        """`copy.deepcopy(model)` copies this as the accelerator of the copy (deepcopy makes the model before
        its attributes, so the copy has no weights yet: nothing is packed until its first pass). A copy of this
        alone accelerates nothing: None."""
        model = self.model()
        copied_model = None if model is None else memo.get(id(model))
        if copied_model is None:
            return None
        clone = FastGPT2.__new__(FastGPT2)
        clone.__dict__.update(self.__dict__)
        clone.model = weakref.ref(copied_model)
        clone.threads = None if self.threads is None else ThreadChooser()
        clone.packed, clone.table, clone.table_key, clone.table_tensors = {}, None, None, []
        clone.watch_optimizers()
        return clone

    def __reduce__(self):
        """Pickled (`torch.save(model)`, multiprocessing), the accelerator is dropped, since it holds C pointers:
        the model unpickles with `accelerator = None`, on the readable path until accelerated again."""
        return type(None), ()

    # -- the seam -------------------------------------------------------------

    def __call__(
        self, x: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None, last_logits_only: bool
    ) -> torch.Tensor | None:
        """The logits of this pass, or None where it cannot take it.

        Args:
            x: (B, T, C) the blocks' input (embeddings).
            cache: the KV cache; row b holds cache.lengths[b] positions, and
                the T new keys and values go at [lengths[b], lengths[b] + T).
                (The model moves the lengths on afterwards.) None: a scratch
                cache for this pass.
            mask: (T, W) bool, which new tokens (and, W > T, which of the
                W - T last cached positions) each new token sees; None: causal.
            last_logits_only: the LM head for the last position only.

        Returns:
            (B, T, V) logits, or (B, 1, V); or None.
        """
        model = self.model()
        if model is None or not self.takes(model, x, cache, mask):
            return None
        table = self.block_table(model)
        if table is None:
            return None  # a parameter the kernels cannot read: the readable path
        B, T, C = x.shape
        if cache is None:
            cache = KVCache(model.config, B, capacity=T)
        out = x.contiguous().clone()  # (B, T, C): the kernel updates it in place, block after block
        mask_bytes = None if mask is None else mask.to(torch.uint8).contiguous()  # (T, W)

        def forward() -> torch.Tensor:
            chunks = -(-T // MAX_NEW_TOKENS)  # one call, or a long pass (a prefill, a large tree) in equal chunks
            bounds = [T * i // chunks for i in range(chunks + 1)]
            for t0, t1 in zip(bounds, bounds[1:]):
                chunk = out if t1 - t0 == T else out[:, t0:t1].contiguous()  # (B, t1 - t0, C)
                # Its mask: its rows, over the window's cached keys, the earlier chunks (cached by now) and itself.
                chunk_mask = None if mask_bytes is None else mask_bytes[t0:t1, : mask_bytes.size(1) - T + t1]
                self.run_blocks(model, table, chunk, cache, cache.lengths + t0, chunk_mask)
                if chunk is not out:
                    out[:, t0:t1] = chunk
            return self.head(model, out[:, -1:, :] if last_logits_only else out)  # (B, 1 or T, V)

        return forward() if self.threads is None else self.threads.run(B * T, forward)

    def takes(self, model: GPT2, x: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None) -> bool:
        """CPU float32 input, cache and mask, no autocast, no gradient to
        record (backward or forward mode), no torch.compile or jit.trace
        recording the pass (they would free the tensors whose pointers the
        kernels get), and widths the kernels take."""
        if torch.jit.is_tracing() or compiling():
            return False
        if not (plain_cpu(x) and x.dtype == torch.float32) or autocast_on():
            return False
        if getattr(fwAD, "_current_level", -1) >= 0 or fwAD.unpack_dual(x).tangent is not None:
            return False  # forward-mode AD: a tangent on the input or on any parameter
        if cache is not None and not (
            cache_readable(cache.k) and cache_readable(cache.v) and cache.k.stride() == cache.v.stride()
            and cache.lengths.is_cpu
        ):
            return False
        B, T, C = x.shape
        if C % 8 or (C // model.config.n_head) % 8 or (mask is not None and not plain_cpu(mask)):
            return False
        if mask is not None and T > MAX_NEW_TOKENS and mask[:, mask.size(1) - T:].triu(1).any():
            return False  # a token that sees a later one: the pass's chunks (below) would hide it
        return not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in model.parameters())))

    def why_not(self, model: GPT2) -> str | None:
        """Why no pass of `model` can take the kernels as its modules and parameters are now; None if one can.
        It packs nothing (for `status`)."""
        tensors = self.parameters_now(model)
        if tensors is None:
            return "a module the kernels stand in for was replaced, hooked, given a forward or an epsilon of its own"
        if any(t is None or t.is_inference() for t in tensors):
            return "a parameter is missing or was made under torch.inference_mode() (accelerate again)"
        if not all(map(kernel_readable, tensors)):
            return "a parameter is not a plain contiguous CPU float32 tensor"
        if [t.shape for t in tensors] != self.shapes or any(w.size(1) % 8 for w in tensors[-1:]):
            return "a module or weight of another size than the config's was put in"
        return None

    # -- the C calls ----------------------------------------------------------

    def run_blocks(
        self, model: GPT2, table: ctypes.Array, x: torch.Tensor, cache: KVCache, starts: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> None:
        """x (B, T, C) <- every block applied; the new keys and values into `cache` at `starts`."""
        B, T, C = x.shape
        scratch = torch.empty(9 * B * T * C, dtype=torch.float32, device="cpu")  # qkv (3C), y, x2 (C), h (4C) a row
        k, v = cache.k, cache.v  # (L, B, nh, S, hs) x 2
        starts = starts.to(torch.int64).contiguous()  # (B,)
        mask = None if mask is None else mask.contiguous()  # (T, W) bytes, rows of W
        self.kernels.blocks(
            table, model.config.n_layer, x.data_ptr(), scratch.data_ptr(),
            B, T, C, model.config.n_head, model.config.layer_norm_epsilon,
            k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
            starts.data_ptr(), None if mask is None else mask.data_ptr(), T if mask is None else mask.size(1),
        )

    def head(self, model: GPT2, x: torch.Tensor) -> torch.Tensor:
        """ln_f, then the tied LM head: (B, T, C) -> (B, T, V)."""
        B, T, C = x.shape
        x = x.reshape(B * T, C).contiguous()  # (N, C)
        packed = self.packed["wte.weight"]
        data, scale = packed.pointers
        V = model.config.vocab_size
        logits = torch.empty(B * T, V, dtype=torch.float32, device="cpu")  # (N, V), every element written by the kernel
        ln_f = model.ln_f
        self.kernels.linear(
            x.data_ptr(), data, scale, None, logits.data_ptr(), B * T, C, V,
            ln_f.weight.data_ptr(), ln_f.bias.data_ptr(), ln_f.eps, 0, None,
        )
        return logits.view(B, T, V)

    # -- keeping the copies and the table current ------------------------------

    def parameters_now(self, model: GPT2) -> list[torch.Tensor] | None:
        """Every block parameter in BlockPointers order, then ln_f and wte,
        looked up through the modules' own dicts (attribute access on an
        nn.Module is far slower than a dict lookup, and this runs at every pass).
        None unless every module the kernels stand in for is the stock one, as
        the readable path would run it: no forward hook (its own or a global
        one), not replaced or subclassed (an adapter, a parametrization), no
        forward of its own, a block's layer norms with the config's epsilon."""
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return None
        if len(model.h) != len(self.names) // 12:  # blocks added or cut since
            return None
        eps, tensors = model.config.layer_norm_epsilon, []
        for block in model.h:
            parts = block._modules
            attn, mlp = parts["attn"], parts["mlp"]
            modules = (parts["ln_1"], attn._modules["c_attn"], attn._modules["c_proj"], parts["ln_2"],
                       mlp._modules["c_fc"], mlp._modules["c_proj"])
            if not all(map(stock, (block, attn, mlp, *modules), BLOCK_KINDS)):
                return None
            if modules[0].eps != eps or modules[3].eps != eps:  # blocks.c takes the config's epsilon
                return None
            for module in modules:
                tensors += (module._parameters["weight"], module._parameters["bias"])
        ln_f = model._modules["ln_f"]
        if not stock(ln_f, nn.LayerNorm):
            return None
        ln_f = ln_f._parameters
        return [*tensors, ln_f["weight"], ln_f["bias"], model._modules["wte"]._parameters["weight"]]

    def block_table(self, model: GPT2) -> ctypes.Array | None:
        """The pointer table of the parameters as they are now (rebuilt, and
        changed weights packed again, whenever a parameter changed); None
        where the readable path must run (`parameters_now`), or a parameter
        is not CPU float32 and contiguous, or not of the packed shapes."""
        tensors = self.parameters_now(model)
        if tensors is None:
            return None
        try:
            key = [t.data_ptr() for t in tensors] + [t._version for t in tensors]
        except RuntimeError:  # a tensor made under inference mode has no version counter to watch
            return None
        except AttributeError:  # a parameter set to None (a Linear or LayerNorm without a bias)
            return None
        if key == self.table_key and not self.optimizer_stepped:
            return self.table
        if not all(map(kernel_readable, tensors)):
            return None
        if [t.shape for t in tensors] != self.shapes:  # a module or weight of another size put in
            return None
        matrices = [tensors[12 * i + s] for i in range(model.config.n_layer) for s in MATRIX_SLOTS] + [tensors[-1]]
        stepped, self.optimizer_stepped = self.optimizer_stepped, False
        with torch.no_grad():
            for name, w in zip(self.matrix_names, matrices):
                kept = self.packed.get(name)
                if kept is None or kept.source != stamp(w) or stepped:
                    if w.size(1) % 8:
                        return None
                    self.packed[name] = packed_copy(w, self.int8)
        table = (BlockPointers * model.config.n_layer)()
        for i, entry in enumerate(table):
            t = tensors[12 * i : 12 * i + 12]
            names = self.names[12 * i : 12 * i + 12]
            entry.ln_1_weight, entry.ln_1_bias = t[0].data_ptr(), t[1].data_ptr()
            entry.c_attn, entry.c_attn_scale = self.packed[names[2]].pointers
            entry.c_attn_bias = t[3].data_ptr()
            entry.attn_proj, entry.attn_proj_scale = self.packed[names[4]].pointers
            entry.attn_proj_bias = t[5].data_ptr()
            entry.ln_2_weight, entry.ln_2_bias = t[6].data_ptr(), t[7].data_ptr()
            entry.c_fc, entry.c_fc_scale = self.packed[names[8]].pointers
            entry.c_fc_bias = t[9].data_ptr()
            entry.mlp_proj, entry.mlp_proj_scale = self.packed[names[10]].pointers
            entry.mlp_proj_bias = t[11].data_ptr()
        self.table, self.table_key, self.table_tensors = table, key, tensors
        return table


def stock(module: nn.Module, kind: type) -> bool:
    """`module` is a `kind` itself (no subclass) with no forward hook or
    forward method of its own."""
    return type(module) is kind and not (
        module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
    )


def compiling() -> bool:
    """Whether torch.compile (dynamo) is tracing this code."""
    check = getattr(torch.compiler, "is_compiling", None)  # torch >= 2.3
    if check is None:
        from torch._dynamo import is_compiling as check
    return check()


def autocast_on() -> bool:
    """Whether CPU autocast is on: the readable path then computes in its dtype."""
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch before 2.4
        return torch.is_autocast_cpu_enabled()


def own_ordinary_tensors(model: nn.Module) -> None:
    """Replaces every parameter made under `torch.inference_mode()` (such
    tensors have no version counter, so an in-place edit could not be seen)
    by an ordinary tensor with the same values."""
    with torch.inference_mode(False), torch.no_grad():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_inference():
                    module._parameters[name] = nn.Parameter(p.clone(), requires_grad=p.requires_grad)
