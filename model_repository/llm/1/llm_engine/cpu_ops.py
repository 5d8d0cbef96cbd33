"""Fused CPU kernels for a decoder layer's small ops (``csrc/cpu_ops.c``), built at load.

On CPU a decode step of a small model is bound by dispatch, not arithmetic: SmolLM2-135M
ran ~1350 ATen calls per step, and everything but the 151 matmuls took 12 ms of a 33-45 ms
step at one row and 20 ms at 32 rows. These kernels do a layer's norms, rotary embedding,
KV-cache write, paged attention and SiLU product in five calls, and read the KV pool in
place instead of gathering each context first; and the sampler's argmax and logsumexp of
the logits in one call, without the ``[rows, vocab]`` log_softmax (1.1-2.4 against 0.5 ms
a step at 32 rows). Built with OpenMP where the compiler has
it, they share torch's OpenMP runtime and split a step's rows over torch's threads.

The C file is compiled once per machine with the system C compiler (``$CC``, else ``cc``)
into the cache directory, keyed by the source, the compiler and the CPU's flags, and
loaded with :mod:`ctypes`. Where no compiler is found, or the build fails, the runner
keeps its torch path, which gives the same tokens up to last-bit rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from .cpu_cores import c_compiler
from .cpu_ops_gguf import GgufBlockOps
from .weights import cache_root

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / name
           for name in ("cpu_ops.c", "linear_amx.c", "linear_avx512bf16.c", "linear_q4.c", "linear_q8.c",
                         "linear_q4_avx2.c", "linear_q8_avx2.c", "decoder_layers.c")]
HEADERS = [Path(__file__).with_name("csrc") / name for name in ("bf16_linear.h", "gguf_blocks.h")]  # in the build key, not compiled alone
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC",
          "-shared"]
OPENMP = "-fopenmp"  # tried first; a compiler without OpenMP builds single-threaded kernels
ABI_VERSION = 9
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# The long kernels (paged attention, the bfloat16 Linears, the logits' argmax and logsumexp,
# the whole decoder stack; C symbol prefixes) let go of the GIL while they run, so the Python
# stub's sender thread can build and send responses meanwhile instead of waiting for the
# engine thread to hand it over;
# at 32 streams on a 2-core Sapphire Rapids, over eight runs taking turns (15 s loads and
# full bench runs), the stack served 361-387 tokens/s with them releasing it against
# 329-371 without (means 376 and 346); the engine alone did not change beyond its noise
# (558-646 against 594-687). The short ones keep it: each retake could wait behind the
# sender thread.
RELEASE_GIL = ("paged_attention", "linear_amx_bf16", "linear_avx512_bf16", "linear_q4_bf16", "linear_q8_bf16",
               "argmax_logsumexp", "decoder_layers")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "rope_store_kv": [_P, _I, _P, _P, _P, _I, _I, _I, _P, _P, _P, _I],
    "paged_attention": [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F],
    "silu_mul": [_P, _P, _I, _I],
}

# The bfloat16 Linears, best first: kind -> (C symbol, the multiple of K it needs). AMX tiles
# (linear_amx.c), else AVX512-BF16 (linear_avx512bf16.c); both batch-invariant by
# construction, oneDNN serves the rest. Each has <symbol>_init(), which returns 0 where the
# library was built without the instructions (or Linux refused AMX's tile state), and
# <symbol> and <symbol>_pack, which only such a build defines.
_BF16_LINEARS = {"amx": ("linear_amx_bf16", 32), "avx512_bf16": ("linear_avx512_bf16", 2)}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def build_library() -> Path | None:
    """The compiled library for this machine, built into the cache on first use; None if it can't be.

    The OpenMP build is tried first, then a single-threaded one. Each is cached under a key
    of its own flags, so a failed OpenMP build (a compiler without it, or a passing fault)
    is tried again at the next load instead of the fallback standing in for it for good.
    """
    cc = c_compiler()
    if cc is None:
        log.warning("no C compiler found; the fused CPU kernels are off (the torch path is used)")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("C compiler %s unusable (%s); the fused CPU kernels are off", cc, exc)
        return None
    sources = [src.read_text() for src in [*SOURCES, *HEADERS]]
    for flags in ([*CFLAGS, OPENMP], CFLAGS):
        key = hashlib.sha256("\0".join([*sources, version, " ".join(flags), _cpu_flags()]).encode())
        target = cache_root() / "kernels" / f"cpu_ops-{key.hexdigest()[:16]}.so"
        if target.is_file() or _compile(cc, flags, target):
            return target
    log.warning("the torch path is used instead of the fused CPU kernels")
    return None


def _compile(cc: str, flags: list[str], target: Path) -> bool:
    """Build ``target`` with ``flags``; a failure leaves no file behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            log.warning("building the fused CPU kernels with %s failed:\n%s", " ".join(flags), proc.stderr[-2000:])
            return False
        os.replace(tmp, target)  # atomic: instances building at once each leave a whole file
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("building the fused CPU kernels with %s failed (%s)", " ".join(flags), exc)
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the fused CPU kernels: %s", target)
    return True


def ptr_or_none(t: torch.Tensor | None) -> int | None:
    """``t``'s address, or None (C's NULL) for no tensor."""
    return None if t is None else t.data_ptr()


class CpuOps(GgufBlockOps):
    """The kernels of one dtype; tensors must be contiguous and on the CPU (those on GGUF
    blocks: :class:`~.cpu_ops_gguf.GgufBlockOps`)."""

    def __init__(self, lib: ctypes.PyDLL, lib_nogil: ctypes.CDLL, dtype: torch.dtype):
        suffix = _SUFFIX[dtype]
        self.dtype = dtype

        def bind(symbol: str, argtypes: list, restype=None):
            fn = getattr(lib_nogil if symbol.startswith(RELEASE_GIL) else lib, symbol)
            fn.argtypes, fn.restype = argtypes, restype
            return fn

        self._set_threads = bind("cpu_ops_set_threads", [ctypes.c_int])
        self._argmax_logsumexp = bind("argmax_logsumexp_f32", [_P, _I, _I, _P, _P])  # logits: float32 always
        for name, argtypes in _SIGNATURES.items():
            setattr(self, f"_{name}", bind(f"{name}_{suffix}", argtypes))
        self._linear_row = self._linear_bf16 = None
        self.bf16_kernel: str | None = None  # a key of _BF16_LINEARS: what linear_bf16 runs on
        if dtype == torch.float32:
            self._linear_row = bind("linear_row_f32", [_P, _P, _P, _P, _I, _I])
        else:
            self.bf16_kernel = next((kind for kind, (symbol, _) in _BF16_LINEARS.items()
                                     if bind(f"{symbol}_init", [], ctypes.c_int)()), None)
        self._decoder_layers = None
        self._bind_gguf(bind)
        if self.bf16_kernel:
            symbol = _BF16_LINEARS[self.bf16_kernel][0]
            self._linear_bf16 = bind(symbol, [_P, _P, _P, _P, _I, _I, _I])
            self._bf16_pack = bind(f"{symbol}_pack", [_P, _P, _I, _I])
            self._decoder_layers = bind("decoder_layers_bf16", [_P, _P])

    @property
    def linear_bf16_address(self) -> int | None:
        """The bfloat16 Linear's C function, for kernels that call it themselves."""
        return ctypes.cast(self._linear_bf16, ctypes.c_void_p).value if self._linear_bf16 else None

    def decoder_layers(self, model: ctypes.Structure, step: ctypes.Structure) -> None:
        """Every decoder layer of a bfloat16 step (``csrc/decoder_layers.c``; see :mod:`.fused_layers`)."""
        self._decoder_layers(ctypes.addressof(model), ctypes.addressof(step))

    def set_threads(self, threads: int) -> None:
        """How many threads a call with enough work is split over (process-wide; 1 at load)."""
        self._set_threads(threads)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, out: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> None:
        """``h += delta`` in place (when given), then ``out = rms_norm(h) * weight`` (when given)."""
        rows, dim = h.shape
        self._add_rms_norm(h.data_ptr(), ptr_or_none(delta), ptr_or_none(out), weight.data_ptr(), rows, dim, eps)

    def rope_store_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin_signed: torch.Tensor, heads: int, kv_heads: int, q_out: torch.Tensor,
                      cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Rotate q and k; q to ``q_out [T, heads, D]``, k and v into ``cache [2, KV, slots, D]``."""
        self._rope_store_kv(qkv.data_ptr(), qkv.shape[0], positions.data_ptr(), cos.data_ptr(),
                            sin_signed.data_ptr(), heads, kv_heads, q_out.shape[-1], q_out.data_ptr(),
                            cache.data_ptr(), slots.data_ptr(), cache.shape[2])

    def paged_attention(self, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                        ctx: torch.Tensor | None, lens: torch.Tensor, ctx_slots: torch.Tensor,
                        scale: float) -> None:
        """Query ``rows`` of ``q [T, H, D]`` over the first ``lens`` slots of their ``ctx_slots``
        row (row ``ctx[i]``, or ``i`` when ``ctx`` is None), into the same rows of ``out``."""
        _, heads, d = q.shape
        self._paged_attention(q.data_ptr(), cache.data_ptr(), out.data_ptr(), rows.data_ptr(), ptr_or_none(ctx),
                              lens.data_ptr(), ctx_slots.data_ptr(), ctx_slots.shape[1], rows.shape[0], heads,
                              cache.shape[1], d, cache.shape[2], scale)

    def argmax_logsumexp(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of float32 ``logits [R, V]``: the first index of its maximum (int64) and its
        logsumexp (float32), without a ``[R, V]`` result."""
        logits = logits.contiguous()
        rows, vocab = logits.shape
        tokens, lse = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
        self._argmax_logsumexp(logits.data_ptr(), rows, vocab, tokens.data_ptr(), lse.data_ptr())
        return tokens, lse

    def silu_mul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out = silu(gate) * up`` for ``x = [gate | up]``."""
        self._silu_mul(x.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])

    @property
    def has_linear_row(self) -> bool:
        return self._linear_row is not None

    def linear_row(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for one float32 row ``x [1, K]`` and ``weight [N, K]`` (on GGUF
        blocks: :meth:`linear_row_blocks`)."""
        x = x.contiguous()
        out = torch.empty(1, weight.shape[0], dtype=torch.float32)
        self._linear_row(x.data_ptr(), weight.data_ptr(), ptr_or_none(bias), out.data_ptr(), weight.shape[0],
                         weight.shape[1])
        return out

    def bf16_fits(self, weight: torch.Tensor) -> bool:
        """Can :meth:`linear_bf16` serve this weight (a bfloat16 kernel here, a bfloat16 weight,
        N % 16 == 0, and K a multiple of 32 on AMX, of 2 on AVX512-BF16)?"""
        n, k = weight.shape
        return (self.bf16_kernel is not None and weight.dtype == torch.bfloat16 and n % 16 == 0
                and k % _BF16_LINEARS[self.bf16_kernel][1] == 0)

    def bf16_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` in the layout :meth:`linear_bf16` reads (same size)."""
        weight = weight.detach().contiguous()
        packed = torch.empty_like(weight)
        self._bf16_pack(weight.data_ptr(), packed.data_ptr(), *weight.shape)
        return packed

    def linear_bf16(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for bfloat16 ``x [M, K]``, ``packed`` from :meth:`bf16_pack` and a
        float32 ``bias``, on AMX tiles or AVX512-BF16 (:attr:`bf16_kernel`); each row's bits are
        the same whatever ``M``."""
        x = x.contiguous()
        m, (n, k) = x.shape[0], packed.shape
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if m:
            self._linear_bf16(x.data_ptr(), packed.data_ptr(), ptr_or_none(bias), out.data_ptr(), m, n, k)
        return out


_library: tuple[ctypes.PyDLL, ctypes.CDLL] | None = None
_library_path: Path | None = None


def library_id() -> str | None:
    """The loaded library's name (``cpu_ops-<key>``: its sources, compiler, flags and CPU), or None."""
    return _library_path.stem if _library_path is not None else None


def load(dtype: torch.dtype) -> CpuOps | None:
    """The kernels for ``dtype``, or None where they can't be had (no compiler, other dtype)."""
    global _library, _library_path
    if dtype not in _SUFFIX:
        return None
    if _library is None:
        path = build_library()
        if path is None:
            return None
        # Two handles on the library: through PyDLL a call keeps the GIL, as torch's ops do;
        # through CDLL it releases and retakes it (see RELEASE_GIL).
        lib = ctypes.PyDLL(str(path))
        lib.cpu_ops_abi_version.restype = ctypes.c_int
        if lib.cpu_ops_abi_version() != ABI_VERSION:
            log.warning("fused CPU kernels at %s have another ABI; the torch path is used", path)
            return None
        _library, _library_path = (lib, ctypes.CDLL(str(path))), path
        runtimes = openmp_runtimes()
        if len(runtimes) > 1:
            log.warning("two OpenMP runtimes in this process (%s): the fused kernels' threads and torch's "
                        "are separate teams; set cpuKernels off if steps get slower", ", ".join(runtimes))
    return CpuOps(*_library, dtype)


def openmp_runtimes(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The OpenMP runtime libraries mapped into this process (Linux; empty elsewhere)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    names = ("libgomp", "libiomp", "libomp")
    return sorted({line.split()[-1] for line in lines if any(n in line.rsplit("/", 1)[-1] for n in names)})
