"""Inductor's CUDA code generation on a machine without a GPU, for one scan graph (used by tests/backend/test_compat.py).

    python tests/backend/fake_cuda_inductor.py [--no-split-scans]

Fakes what Inductor asks of the device (an H200's properties, a Triton target) and stops when Inductor loads the
generated module, which needs the driver. Prints one JSON line: {"codegen": "ok" | "failed" | "harness",
"detail": ..., "split_scan": whether the code uses the split-scan kernel}. "harness" means this torch needs more
faking than is done here (the caller skips). The graph is HF Mamba2's `cumsum(A.permute(0, 3, 1, 2), -1)`, a scan
over a strided axis, which Inductor splits across blocks; torch 2.11 and 2.14's split-scan codegen fail on it.
"""
import contextlib
import json
import sys
import types


class CodegenDone(Exception):
    """Raised where Inductor loads the generated module: code generation is over."""


def fake_cuda() -> None:
    import torch
    import torch._subclasses.fake_tensor as fake_tensor
    from torch._dynamo import device_interface

    props = types.SimpleNamespace(multi_processor_count=132, major=9, minor=0, regs_per_multiprocessor=65536,
                                  max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
                                  name="NVIDIA H200", total_memory=140 << 30, gcnArchName="",
                                  shared_memory_per_block_optin=232448, L2_cache_size=60 << 20)
    iface = device_interface.CudaInterface
    iface.get_device_properties = staticmethod(lambda device=None: props)
    iface.get_compute_capability = staticmethod(lambda device=None: 90)
    iface.is_available = staticmethod(lambda: True)
    iface.current_device = staticmethod(lambda: 0)
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda._lazy_init = lambda: None
    torch.cuda._exchange_device = lambda idx: -1
    torch.cuda._maybe_exchange_device = lambda idx: -1
    fake_tensor.init_gpu_context = lambda device: None

    import torch._dynamo.utils as dynamo_utils
    import torch._inductor.codecache as codecache
    import torch._inductor.compile_fx as compile_fx

    dynamo_utils.preserve_rng_state = contextlib.nullcontext
    if hasattr(compile_fx, "preserve_rng_state"):
        compile_fx.preserve_rng_state = contextlib.nullcontext
    compile_fx.get_cuda_device_context = lambda gm: contextlib.nullcontext()

    import triton.runtime.driver  # noqa: F401  (the module, which the package's `driver` name shadows)
    from triton.backends.compiler import GPUTarget

    class Active:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    drivers = sys.modules["triton.runtime.driver"].driver
    drivers._active = drivers._default = Active()

    def load_by_key_path(cls, key, path, *args, **kwargs):
        with open(path) as f:
            raise CodegenDone(f.read())

    codecache.PyCodeCache.load_by_key_path = classmethod(load_by_key_path)


def main() -> None:
    try:
        fake_cuda()
        import torch
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        mode = FakeTensorMode()
        with mode:
            a = torch.empty(1, 16, 256, 32, device="cuda")  # (batch, chunks, chunk length, heads)
        gm = make_fx(lambda a: (torch.cumsum(a.permute(0, 3, 1, 2) * 2, -1),))(a)
    except Exception as exc:  # noqa: BLE001
        print(json.dumps({"codegen": "harness", "detail": repr(exc)[:300]}))
        return
    if "--no-split-scans" in sys.argv:
        from tk_inductor import _compat

        _compat.disable_split_scans()
    try:
        with mode:
            compile_fx_inner(gm, [a])
        result = {"codegen": "harness", "detail": "Inductor never loaded a module"}
    except Exception as exc:  # noqa: BLE001
        cause = exc
        while not isinstance(cause, CodegenDone) and (cause.__cause__ or cause.__context__):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, CodegenDone):
            code = str(cause)
            result = {"codegen": "ok", "detail": "", "split_scan": "exclusive_scan_decoupled_lookback" in code}
        else:
            frames = []
            tb = cause.__traceback__
            while tb is not None:
                frames.append(tb.tb_frame.f_code.co_filename)
                tb = tb.tb_next
            codegen = any("/_inductor/codegen/" in f for f in frames)
            result = {"codegen": "failed" if codegen else "harness", "detail": repr(cause)[:300],
                      "split_scan": any("split_scan" in f for f in frames)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
