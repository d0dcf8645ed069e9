"""nvJPEG's hardware JPEG decoders (the "NVJPG" engines of the GPUs that have them) through ctypes.

torchvision's ``decode_jpeg(device="cuda")`` reaches the same engines, but behind one process-wide decoder and mutex
and holding Python's GIL for part of each call. Beside a training step, a thread of the training process decodes
fastest with calls of at most as many files as the GPU has engines (calls of more files decode much slower beside
a busy step), and with a decoder of its own rather than torchvision's shared one. ctypes releases the GIL for every
C call, so the training loop's thread keeps it.

The library is the libnvjpeg that torchvision ships (else the system's). :func:`open_hardware_decoder` returns None
where there is no library, no CUDA or no engines; callers then keep torchvision's decoder.
"""
from __future__ import annotations

import ctypes
import glob
import threading
from pathlib import Path

import numpy as np
import torch

from swin.data.gpu.crop_resize import YCbCrImage

BACKEND_DEFAULT, BACKEND_HARDWARE = 0, 3
# planar outputs, plane c at channel[c] with pitch[c]: the file's own YCbCr planes (chroma subsampled as stored; the
# engines write them without any kernel), or RGB (converted by one nvJPEG kernel per image)
OUTPUT_YUV, OUTPUT_RGB = 1, 3
STATUS = {0: "success", 1: "not initialized", 2: "invalid parameter", 3: "bad jpeg", 4: "jpeg not supported",
          5: "allocator failure", 6: "execution failed", 7: "arch mismatch", 8: "internal error",
          9: "implementation not supported", 10: "incomplete bitstream"}


class Image(ctypes.Structure):
    """nvjpegImage_t: up to four planes, each a device pointer and a row pitch in bytes."""
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]


def load_nvjpeg() -> ctypes.CDLL:
    """The libnvjpeg that torchvision ships (torchvision.libs/), else a pip CUDA wheel's or the system's."""
    import torchvision
    here = Path(torchvision.__file__).parent
    candidates = sorted(glob.glob(str(here.parent / "torchvision.libs" / "libnvjpeg*.so*")))
    candidates += sorted(glob.glob(str(here.parent / "nvidia" / "*" / "lib" / "libnvjpeg.so*")))
    candidates += ["libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so"]
    errors = []
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise OSError("no libnvjpeg found:\n" + "\n".join(errors))


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: nvJPEG status {status} ({STATUS.get(status, '?')})")


Blob = bytes | torch.Tensor  # a JPEG file: bytes, or a 1-D uint8 CPU tensor (a view into a batch's buffer)


def _pointer(blob: Blob) -> ctypes.c_void_p | bytes:
    # a bare Python int would go through ctypes as a 32-bit C int
    return ctypes.c_void_p(blob.data_ptr()) if isinstance(blob, torch.Tensor) else blob


class BatchedDecoder:
    """``nvjpegDecodeBatched`` with one backend and output format for calls of exactly ``batch`` files: JPEG files ->
    uint8 planes on the current CUDA device, decoded on the current CUDA stream. Not for two threads at once."""

    def __init__(self, lib: ctypes.CDLL, backend: int, batch: int, output: int = OUTPUT_RGB):
        self.lib, self.batch, self.output = lib, batch, output
        self.handle, self.state = ctypes.c_void_p(), ctypes.c_void_p()
        check(lib.nvjpegCreateEx(ctypes.c_int(backend), None, None, ctypes.c_uint(0), ctypes.byref(self.handle)),
              f"nvjpegCreateEx(backend {backend})")
        check(lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)), "nvjpegJpegStateCreate")
        check(lib.nvjpegDecodeBatchedInitialize(self.handle, self.state, ctypes.c_int(batch), ctypes.c_int(1),
                                                ctypes.c_int(output)), "nvjpegDecodeBatchedInitialize")
        self.stream = ctypes.c_void_p()
        check(lib.nvjpegJpegStreamCreate(self.handle, ctypes.byref(self.stream)), "nvjpegJpegStreamCreate")

    def engines(self) -> tuple[int, int] | None:
        """(hardware decoders, cores per decoder), or None where nvJPEG does not say."""
        engines, cores = ctypes.c_uint(), ctypes.c_uint()
        fn = getattr(self.lib, "nvjpegGetHardwareDecoderInfo", None)
        if fn is None or fn(self.handle, ctypes.byref(engines), ctypes.byref(cores)) != 0:
            return None
        return engines.value, cores.value

    def size(self, blob: Blob) -> tuple[int, int, int]:
        """(components, height, width) of the file's first component."""
        planes = self.plane_sizes(blob)
        return len(planes), *planes[0]

    def plane_sizes(self, blob: Blob) -> list[tuple[int, int]]:
        """(height, width) of each of the file's components, as nvJPEG reads its header."""
        comps, sub = ctypes.c_int(), ctypes.c_int()
        widths, heights = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()
        check(self.lib.nvjpegGetImageInfo(self.handle, _pointer(blob), ctypes.c_size_t(len(blob)),
                                          ctypes.byref(comps), ctypes.byref(sub), widths, heights),
              "nvjpegGetImageInfo")
        return [(heights[c], widths[c]) for c in range(comps.value)]

    def supported(self, blob: Blob) -> bool:
        """Whether this backend's batched decode takes the file (hardware: baseline JPEGs; not progressive)."""
        status = self.lib.nvjpegJpegStreamParse(self.handle, _pointer(blob), ctypes.c_size_t(len(blob)), 0, 0,
                                                self.stream)
        if status != 0:
            return False
        flag = ctypes.c_int()
        check(self.lib.nvjpegDecodeBatchedSupported(self.handle, self.stream, ctypes.byref(flag)),
              "nvjpegDecodeBatchedSupported")
        return flag.value == 0  # 0: supported

    def __call__(self, blobs: list[Blob], sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """RGB output: ``blobs`` (of the given (height, width)) decoded into new (3, H, W) tensors."""
        planes = [[size] * 3 for size in sizes]
        return [b.view(3, *size) for b, size in zip(self.decode_planes(blobs, planes), sizes)]

    def decode_planes(self, blobs: list[Blob], planes: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
        """Decodes ``blobs`` into one new flat uint8 buffer per file, holding its (height, width) planes of the given
        sizes back to back (RGB: three of the image's size; YUV: the file's components, luma first). The files
        must stay alive until the current stream has run the call."""
        n = len(blobs)
        if n != self.batch:
            raise ValueError(f"this decoder takes calls of {self.batch} files (nvjpegDecodeBatchedInitialize), "
                             f"not {n}")
        outs = []
        images = (Image * n)()
        for img, sizes in zip(images, planes):
            counts = [h * w for h, w in sizes]
            outs.append(torch.empty(sum(counts), dtype=torch.uint8, device="cuda"))
            for c, (start, (_, w)) in enumerate(zip(np.cumsum([0, *counts[:-1]]).tolist(), sizes)):
                img.channel[c] = outs[-1].data_ptr() + start
                img.pitch[c] = w
        data = (ctypes.c_void_p * n)(*[ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value
                                       if isinstance(b, bytes) else b.data_ptr() for b in blobs])
        lengths = (ctypes.c_size_t * n)(*[len(b) for b in blobs])
        current = torch.cuda.current_stream()
        # nvJPEG's engines write the outputs without waiting for the work already queued on the stream
        # (pytorch/vision#9606): were a block of `outs` freed by queued kernels still reading it, they would read
        # the new image. Nothing may be queued when it decodes.
        current.synchronize()
        stream = ctypes.c_void_p(current.cuda_stream)
        check(self.lib.nvjpegDecodeBatched(self.handle, self.state, data, lengths, images, stream),
              "nvjpegDecodeBatched")
        return outs


_LIB: list[ctypes.CDLL | None] = []
_LIB_LOCK = threading.Lock()


def _library() -> ctypes.CDLL | None:
    with _LIB_LOCK:
        if not _LIB:
            try:
                _LIB.append(load_nvjpeg())
            except OSError:
                _LIB.append(None)
        return _LIB[0]


class HardwareJpegDecoder:
    """Lists of JPEG files decoded by the GPU's JPEG engines, one :class:`BatchedDecoder` per call size (nvJPEG fixes
    it at initialisation). The caller gives each file's plane sizes (swin.data.gpu.decode.engine_planes: luma, then
    chroma) and sends only files the engines take (baseline; with YUV output three components; asking nvJPEG per
    file would parse each whole file on the host). Waits for each call on the current stream, so that the files may
    be freed after it. One thread at a time.

    Output: (3, H, W) uint8 RGB tensors, or with ``ycbcr`` each file's YCbCr planes as stored
    (swin.data.gpu.crop_resize.YCbCrImage), which the crop kernels convert: no nvJPEG conversion kernel per image."""

    def __init__(self, lib: ctypes.CDLL, first: BatchedDecoder):
        self.lib, self.decoders, self.ycbcr = lib, {first.batch: first}, first.output == OUTPUT_YUV

    def decode(self, blobs: list[Blob], planes: list[list[tuple[int, int]]]) -> list[torch.Tensor | YCbCrImage]:
        if self.ycbcr and any(len(p) != 3 for p in planes):
            raise ValueError("YCbCr output takes files of three components (grey ones: RGB output)")
        images, start = [], 0
        for n in self.call_sizes(len(blobs)):
            images += self._call(blobs[start:start + n], planes[start:start + n])
            start += n
        return images

    def call_sizes(self, n: int) -> list[int]:
        """One call of ``n`` files where a decoder of that size exists, else calls of powers of two, largest first:
        nvJPEG fixes a decoder's batch size, and batches holding a few files the engines refuse would otherwise
        make (and keep) a decoder for every count."""
        if n in self.decoders:
            return [n]
        return [1 << k for k in reversed(range(n.bit_length())) if n >> k & 1]

    def _call(self, blobs: list[Blob], planes: list[list[tuple[int, int]]]) -> list[torch.Tensor | YCbCrImage]:
        n = len(blobs)
        if n not in self.decoders:
            self.decoders[n] = BatchedDecoder(self.lib, BACKEND_HARDWARE, n, OUTPUT_YUV if self.ycbcr else OUTPUT_RGB)
        if not self.ycbcr:
            images = self.decoders[n](blobs, [p[0] for p in planes])
            torch.cuda.current_stream().synchronize()
            return images
        buffers = self.decoders[n].decode_planes(blobs, planes)
        torch.cuda.current_stream().synchronize()
        return [YCbCrImage(*(part.view(size) for part, size in zip(b.split([h * w for h, w in p]), p)))
                for b, p in zip(buffers, planes)]


def open_hardware_decoder(device: torch.device, files_per_call: int, ycbcr: bool = False
                          ) -> HardwareJpegDecoder | None:
    """A decoder on ``device``'s JPEG engines (``ycbcr``: YUV output, see HardwareJpegDecoder), or None: no CUDA, no
    libnvjpeg, or a GPU without engines."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    lib = _library()
    if lib is None:
        return None
    with torch.cuda.device(device):
        try:
            first = BatchedDecoder(lib, BACKEND_HARDWARE, files_per_call, OUTPUT_YUV if ycbcr else OUTPUT_RGB)
        except RuntimeError:  # "implementation not supported": no engines on this GPU
            return None
    engines = first.engines()
    if engines is not None and engines[0] == 0:
        return None
    return HardwareJpegDecoder(lib, first)


__all__ = ["BACKEND_DEFAULT", "BACKEND_HARDWARE", "OUTPUT_RGB", "OUTPUT_YUV", "BatchedDecoder",
           "HardwareJpegDecoder", "Image", "check", "load_nvjpeg", "open_hardware_decoder"]
