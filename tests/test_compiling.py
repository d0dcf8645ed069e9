"""swin.compile_model: torch.compile with the mode's options plus ours, as train.py, eval.py and the benchmark
compile the model (its compiled numerics: the GPU tests of test_flash_window.py and test_backbone.py)."""
import pytest
import torch
import torch._inductor

import swin
from swin.models.compiling import COMBO_KERNEL_OPTIONS


@pytest.fixture
def compile_calls(monkeypatch):
    """torch.compile's keyword arguments, call by call (the real torch.compile still runs: nothing is traced until
    the model is called)."""
    calls = []
    real = torch.compile

    def spy(model, **kwargs):
        calls.append(kwargs)
        return real(model, **kwargs)
    monkeypatch.setattr(torch, "compile", spy)
    return calls


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead", "max-autotune"])
@pytest.mark.parametrize(("dynamic", "fullgraph"), [(False, False), (None, True), (True, False)])
def test_compile_model_adds_our_options_to_the_mode(compile_calls, mode, dynamic, fullgraph):
    """Combo kernels on top of every mode's options, CUDA graphs' included."""
    model = torch.nn.Linear(4, 4)
    compiled = swin.compile_model(model, mode, dynamic=dynamic, fullgraph=fullgraph)
    assert compiled is not model and compiled._orig_mod is model
    (kwargs,) = compile_calls
    graphs = mode in ("reduce-overhead", "max-autotune")
    expected = {**torch._inductor.list_mode_options(mode or "default", dynamic), **COMBO_KERNEL_OPTIONS}
    assert kwargs["options"] == expected and "mode" not in kwargs
    assert kwargs["dynamic"] is dynamic and kwargs["fullgraph"] is fullgraph
    assert expected["combo_kernels"] is True  # torch 2.14 combines dynamic ones
    assert expected.get("triton.cudagraphs", False) == graphs


def test_dynamic_shapes_drop_combo_kernels_where_torch_cannot_combine_them(monkeypatch):
    """torch 2.11's combo kernels raise on a persistent reduction over a dynamic dimension: dynamic=True compiles
    without them there, static and automatic-dynamic compiles keep them."""
    from swin.models import compiling

    monkeypatch.setattr(compiling, "combo_kernels_take_dynamic_reductions", lambda: False)
    options = compiling.inductor_options("reduce-overhead", dynamic=True)
    assert not any(k.startswith("combo_kernel") for k in options) and options["triton.cudagraphs"] is True
    assert compiling.inductor_options("reduce-overhead", dynamic=False)["combo_kernels"] is True
    assert compiling.inductor_options("default", dynamic=None)["combo_kernels"] is True
    assert "combo_kernels" not in compiling.inductor_options("default", dynamic=True)
    forced = compiling.inductor_options("default", dynamic=True, overrides={"combo_kernels": True})
    assert forced["combo_kernels"] is True  # an explicit override is the caller's choice


def test_default_mode_training_on_cuda_takes_the_cpp_wrapper_instead_of_combo_kernels():
    """The C++ wrapper for the default mode's training graphs on CUDA (static or automatic-dynamic shapes), combo
    kernels everywhere else; an override turns it off and gives the combo kernels back."""
    from swin.models import compiling

    assert compiling.inductor_options("default", None, device_type="cuda") == {"cpp_wrapper": True}
    assert compiling.inductor_options(None, False, device_type="cuda") == {"cpp_wrapper": True}
    off = compiling.inductor_options("default", None, {"cpp_wrapper": False}, device_type="cuda")
    assert off == {**COMBO_KERNEL_OPTIONS, "cpp_wrapper": False}
    for mode, dynamic, device, training in (("default", None, "cpu", True), ("reduce-overhead", None, "cuda", True),
                                            ("max-autotune-no-cudagraphs", False, "cuda", True),
                                            ("default", None, "cuda", False)):
        options = compiling.inductor_options(mode, dynamic, device_type=device, training=training)
        assert "cpp_wrapper" not in options and options["combo_kernels"] is True, (mode, device, training)
    assert "cpp_wrapper" not in compiling.inductor_options("default", True, device_type="cuda")


def test_cpp_wrapper_for_training_graphs_compiled_with_their_backward(compile_calls, monkeypatch):
    """Default mode on CUDA: a graph compiled with gradients gets the C++ wrapper, with AOTAutograd's
    force_non_lazy_backward_lowering on inside the backend call only (a lazily compiled backward misses the C++
    wrapper's settings on torch 2.11) and the activation memory budget beside it; a graph compiled without gradients
    (validation) gets the Python wrapper and combo kernels."""
    from swin.models import compiling

    monkeypatch.setattr(compiling, "_device_type", lambda model: "cuda")
    seen = []

    def backend_call(self, graph, example_inputs):
        config = torch._functorch.config
        seen.append((config.force_non_lazy_backward_lowering, config.activation_memory_budget, self.config))
        return graph.forward
    monkeypatch.setattr(torch._TorchCompileInductorWrapper, "__call__", backend_call)
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    for budget in (None, 0.5):
        compiled = swin.compile_model(model, dynamic=False, memory_budget=budget)
        torch.testing.assert_close(compiled(x), model(x))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
        torch._dynamo.reset()
    cpp, combo = {"cpp_wrapper": True}, dict(COMBO_KERNEL_OPTIONS)
    assert seen == [(True, 1.0, cpp), (False, 1.0, combo), (True, 0.5, cpp), (False, 1.0, combo)]
    assert torch._functorch.config.force_non_lazy_backward_lowering is False
    backends = [kwargs["backend"] for kwargs in compile_calls]
    assert [b.functorch_config for b in backends] == [
        {"force_non_lazy_backward_lowering": True},
        {"activation_memory_budget": 0.5, "force_non_lazy_backward_lowering": True}]
    assert all(b.inference.config == combo for b in backends)


def test_compile_model_reads_the_models_device():
    from swin.models import compiling

    assert compiling._device_type(torch.nn.Linear(2, 2)) == "cpu"
    assert compiling._device_type(torch.nn.Linear(2, 2, device="meta")) == "meta"
    assert compiling._device_type(torch.nn.ReLU()) == "cpu"


def test_combo_kernel_support_is_read_from_inductor(monkeypatch):
    """The check looks for the old inductor's refusal in its combo-kernel code generator."""
    from swin.models import compiling

    detect = compiling.combo_kernels_take_dynamic_reductions.__wrapped__
    assert detect() is True  # torch 2.14's inductor
    old = 'raise RuntimeError("Dynamic shape on reduction dimension is not supported")'
    monkeypatch.setattr(compiling.inspect, "getsource", lambda module: f"def f():\n    {old}\n")
    assert detect() is False


def test_compile_model_names_a_bad_mode():
    with pytest.raises(ValueError, match="torch.compile mode 'fastest'.*reduce-overhead"):
        swin.compile_model(torch.nn.Linear(4, 4), "fastest")


@pytest.mark.parametrize("overrides", [[], ["+train.compile_options.combo_kernels=true",
                                               "+train.compile_options.triton.mix_order_reduction=false"]])
def test_train_setup_compiles_through_compile_model(compile_calls, tmp_path, overrides):
    """train.py's model is compiled with the same options, and train.compile_options over them (the model is
    built, not run)."""
    from _train_utils import DET, make_cfg

    from swin.config import to_settings
    from swin.train.distributed import DistInfo
    from swin.train.setup import setup

    cfg = make_cfg(*DET, "device=cpu", "train.compile=true", "train.compile_mode=reduce-overhead", *overrides)
    run = setup(to_settings(cfg), tmp_path, DistInfo(0, 0, 1, torch.device("cpu")))
    (kwargs,) = compile_calls
    expected = {"triton.cudagraphs": True, **COMBO_KERNEL_OPTIONS}
    if overrides:
        expected.update({"combo_kernels": True, "triton.mix_order_reduction": False})
    assert kwargs["options"] == expected
    assert run.fwd_model._orig_mod is run.raw_model


def test_unknown_compile_option_is_one_config_error():
    from _train_utils import make_cfg

    from swin.config import ConfigError
    from swin.train.checks import check_config

    cfg = make_cfg("+train.compile_options.combo_kernel=false")
    with pytest.raises(ConfigError, match=r"train.compile_options: inductor option\(s\) \['combo_kernel'\] unknown"):
        check_config(cfg, 1, torch.device("cpu"))


def _saved_bytes_and_grads(model: torch.nn.Module, compiled: torch.nn.Module, x: torch.Tensor):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return sum(saved), grads


def test_memory_budget_saves_less_for_the_backward_with_the_same_gradients():
    """memory_budget below 1: the partitioner recomputes cheap ops (the norm, GELU) instead of saving them; the
    budget belongs to that compiled model (the process-wide setting is untouched); gradients equal eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    x = torch.randn(512, 64, requires_grad=False)
    _, eager_grads = _saved_bytes_and_grads(model, model, x)
    default_bytes, default_grads = _saved_bytes_and_grads(model, swin.compile_model(model, dynamic=False), x)
    budget_bytes, budget_grads = _saved_bytes_and_grads(
        model, swin.compile_model(model, dynamic=False, memory_budget=0.3), x)
    assert torch._functorch.config.activation_memory_budget == 1.0
    assert budget_bytes < 0.8 * default_bytes, (budget_bytes, default_bytes)
    for eager, default, budget in zip(eager_grads, default_grads, budget_grads, strict=True):
        torch.testing.assert_close(default, eager, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(budget, eager, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("budget", [0, -0.5, 1.5, "half", True])
def test_a_bad_memory_budget_is_one_line(budget):
    with pytest.raises(ValueError, match=r"^memory_budget=.*: use a fraction in \(0, 1\]"):
        swin.compile_model(torch.nn.Linear(4, 4), memory_budget=budget)


def test_train_setup_passes_its_memory_budget(compile_calls, tmp_path):
    from _train_utils import DET, make_cfg

    from swin.config import ConfigError, to_settings
    from swin.models.compiling import _InductorBackend
    from swin.train.checks import check_config
    from swin.train.distributed import DistInfo
    from swin.train.setup import setup

    cfg = make_cfg(*DET, "device=cpu", "train.compile=true", "train.compile_mode=reduce-overhead",
                   "train.memory_budget=0.6")
    run = setup(to_settings(cfg), tmp_path, DistInfo(0, 0, 1, torch.device("cpu")))
    (kwargs,) = compile_calls
    backend = kwargs["backend"]
    assert isinstance(backend, _InductorBackend)
    assert backend.functorch_config == {"activation_memory_budget": 0.6}
    assert backend.config == {"triton.cudagraphs": True, **COMBO_KERNEL_OPTIONS}  # the options without a budget
    assert run.fwd_model._orig_mod is run.raw_model
    with pytest.raises(ConfigError, match=r"^train.memory_budget=1.5: use a fraction in \(0, 1\]"):
        check_config(make_cfg("train.memory_budget=1.5"), 1, torch.device("cpu"))
