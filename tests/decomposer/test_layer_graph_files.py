"""LayerGraph files: save/load round trip, generated code, state dicts, tied parameters, tampering."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch

import harmony
from harmony.decomposer.layer_graph import LayerGraph
from zoo import FACTORIES, RTOL, assert_close, assert_layers_match_model, tensor_leaves

ROUND_TRIP_MODELS = ["gpt2", "resnet", "hf_bert"]  # fx and export traces (hf_gpt2: see the tied test)


def _decomposed(name, tmp_path, dtype=torch.float64, train=False):
    model, inputs = FACTORIES[name](dtype, dropout=False)
    model.train(train)
    lg = harmony.decompose(model, inputs)
    lg.save(tmp_path / "graph")
    return model, inputs, lg, tmp_path / "graph"


def _loaded_matches(model, inputs, lg2, rtol):
    lg2.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = tensor_leaves(model(*inputs))
        actual = tensor_leaves(lg2.run_sequential(*inputs))
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, rtol, f"output {i} of the loaded graph")


def test_save_writes_graph_file_and_one_module_per_layer(tmp_path):
    _, _, lg, d = _decomposed("gpt2", tmp_path)
    assert (d / "graph.msgpack").is_file()
    files = sorted(p.name for p in (d / "layers").glob("layer_*.py"))
    assert files == [f"layer_{i:03d}.py" for i in range(len(lg))]
    assert [s.code_file for s in lg.layers] == files


@pytest.mark.parametrize("name", ["resnet", "hf_bert"])
def test_generated_layer_files_are_importable_and_define_one_class_per_layer(tmp_path, name):
    _, _, lg, d = _decomposed(name, tmp_path)
    for spec in lg.layers:
        path = d / "layers" / spec.code_file
        source = path.read_text()
        compile(source, str(path), "exec")
        assert source.count("class ") == 1 and f"class {spec.class_name}(torch.nn.Module)" in source
        mod_name = f"_harmony_test_{name}_{spec.index}"
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(mod_name, path))
        try:
            module.__spec__.loader.exec_module(module)
        finally:
            sys.modules.pop(mod_name, None)
        cls = getattr(module, spec.class_name)
        assert issubclass(cls, torch.nn.Module)
        layer = cls()  # fresh tensors from the recorded shapes
        assert set(layer.state_dict()) <= set(lg.state)


@pytest.mark.parametrize("name", ROUND_TRIP_MODELS)
def test_loaded_graph_with_model_weights_reproduces_outputs_in_train_mode(tmp_path, name):
    model, inputs, lg, d = _decomposed(name, tmp_path, train=True)
    lg2 = LayerGraph.load(d)
    assert lg2.to_dict() == lg.to_dict()
    _loaded_matches(model, inputs, lg2, RTOL[torch.float64])


@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        "hf_bert",  # non-persistent buffers (position_ids, token_type_ids) must be restored
        "resnet",  # batch norm must use its running statistics
    ],
)
def test_loaded_graph_of_eval_model_reproduces_outputs(tmp_path, name):
    model, inputs, lg, d = _decomposed(name, tmp_path, train=False)
    lg2 = LayerGraph.load(d)
    assert lg2.training is False
    _loaded_matches(model, inputs, lg2, RTOL[torch.float64])


def test_loaded_graph_restores_non_persistent_buffers(tmp_path):
    model, inputs, lg, d = _decomposed("hf_bert", tmp_path)
    lg2 = LayerGraph.load(d)
    lg2.load_state_dict(model.state_dict())
    loaded = {n: b for m in lg2.modules for n, b in m.named_buffers()}
    expected = dict(model.named_buffers())
    assert {"bert.embeddings.position_ids", "bert.embeddings.token_type_ids"} <= set(expected)
    for name, buf in expected.items():
        assert name in loaded, name
        assert torch.equal(loaded[name], buf), f"{name} differs after loading"


@pytest.mark.parametrize("name", ["gpt2", "resnet", "hf_bert"])
def test_state_dict_has_model_keys_and_loads_strictly_into_fresh_model(tmp_path, name):
    model, inputs, lg, d = _decomposed(name, tmp_path)
    assert set(lg.state_dict()) == set(model.state_dict())
    lg2 = LayerGraph.load(d)
    lg2.load_state_dict(model.state_dict())
    sd = lg2.state_dict()
    assert set(sd) == set(model.state_dict())
    fresh, _ = FACTORIES[name](torch.float64, dropout=False)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # make sure the values really come from the loaded graph
    fresh.load_state_dict(sd, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_specs_survive_round_trip_without_code(tmp_path):
    _, _, lg, d = _decomposed("bert", tmp_path)
    lg2 = LayerGraph.load(d, with_code=False)
    assert lg2.modules is None
    assert lg2.to_dict() == lg.to_dict()
    assert lg2.layers == lg.layers and lg2.values == lg.values and lg2.state == lg.state
    assert lg2.parameter_bytes() == lg.parameter_bytes()
    with pytest.raises(harmony.DecomposeError):
        lg2.run_sequential(torch.zeros(1, 16, dtype=torch.long))


def test_the_data_half_is_the_graphs_fields_as_plain_data_without_touching_its_modules(tmp_path):
    """``to_dict`` (the file's body and the fingerprint's input) gives every data field as
    ``dataclasses.asdict`` would, and never copies the live layer modules it leaves out."""
    _, _, lg, _ = _decomposed("gpt2", tmp_path)
    plain = dataclasses.asdict(dataclasses.replace(lg, modules=None, _out_spec=None))
    expected = {k: v for k, v in plain.items() if k not in ("modules", "_out_spec", "sources")}

    class Uncopyable(torch.nn.Module):
        def __deepcopy__(self, memo):
            raise AssertionError("a layer module was copied")

    lg.modules = [Uncopyable()]
    assert lg.to_dict() == expected and list(lg.to_dict()) == list(expected)
    assert lg.fingerprint() == LayerGraph.from_dict(lg.to_dict()).fingerprint()


# ------------------------------------------------------------------ tied parameters
@pytest.mark.parametrize("name, canonical, alias", [
    ("gpt2", "wte.weight", "lm_head.weight"),
    ("hf_gpt2", "transformer.wte.weight", "lm_head.weight"),
])
def test_tied_embedding_gets_one_gradient_equal_to_reference_and_survives_reload(tmp_path, name, canonical, alias):
    model, inputs = FACTORIES[name](torch.float64, dropout=False)
    model.eval()
    assert model.get_parameter(canonical) is model.get_parameter(alias)
    lg = assert_layers_match_model(model, inputs, RTOL[torch.float64])  # compares the tied grad once
    assert lg.ties == {canonical: [alias]} or (name == "hf_gpt2" and alias in lg.ties.get(canonical, []))
    n_params = len(list(model.parameters()))
    assert len(list(lg.parameters())) == n_params
    assert lg.modules[0].get_parameter(_name_in(lg, 0, canonical, alias)) is lg.modules[-1].get_parameter(
        _name_in(lg, len(lg) - 1, canonical, alias))

    lg.save(tmp_path / "g")
    lg2 = LayerGraph.load(tmp_path / "g")  # fresh tensors, re-tied
    assert lg2.ties == lg.ties
    assert len(list(lg2.parameters())) == n_params
    first = lg2.modules[0].get_parameter(_name_in(lg2, 0, canonical, alias))
    last = lg2.modules[-1].get_parameter(_name_in(lg2, len(lg2) - 1, canonical, alias))
    assert first is last, "the tied parameter is two tensors after loading"

    # and training through the loaded graph still yields one, correct, gradient
    lg2.load_state_dict(model.state_dict())
    model.zero_grad()
    tensor_leaves(model(*inputs))[0].pow(2).mean().backward()
    tensor_leaves(lg2.run_sequential(*inputs))[0].pow(2).mean().backward()
    assert_close(first.grad, model.get_parameter(canonical).grad, RTOL[torch.float64], "tied gradient")


def _name_in(lg, index, canonical, alias):
    names = lg.layers[index].state
    return canonical if canonical in names else alias


def test_parameter_bytes_count_tied_parameters_once():
    model, inputs = FACTORIES["gpt2"](torch.float32, dropout=False)
    lg = harmony.decompose(model, inputs)
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert lg.parameter_bytes() == expected
    assert sum(lg.parameter_bytes(i) for i in range(len(lg))) == expected + model.wte.weight.numel() * 4


# ------------------------------------------------------------------ refusing damaged files
def test_modified_layer_file_is_refused(tmp_path):
    _, _, lg, d = _decomposed("gpt2", tmp_path)
    path = d / "layers" / "layer_001.py"
    path.write_bytes(path.read_bytes() + b"# edited by hand\n")  # still valid Python
    with pytest.raises(harmony.FormatError, match="layer_001"):
        LayerGraph.load(d)


def test_one_changed_byte_in_layer_file_is_refused(tmp_path):
    _, _, lg, d = _decomposed("resnet", tmp_path)
    path = d / "layers" / "layer_000.py"
    data = bytearray(path.read_bytes())
    data[10] = ord("X") if data[10] != ord("X") else ord("Y")
    path.write_bytes(bytes(data))
    with pytest.raises(harmony.FormatError):
        LayerGraph.load(d)


def test_missing_layer_file_is_refused(tmp_path):
    _, _, lg, d = _decomposed("resnet", tmp_path)
    (d / "layers" / "layer_001.py").unlink()
    with pytest.raises(harmony.FormatError):
        LayerGraph.load(d)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "flipped"])
def test_damaged_graph_file_is_refused_with_format_error(tmp_path, damage):
    _, _, lg, d = _decomposed("resnet", tmp_path)
    path = d / "graph.msgpack"
    data = path.read_bytes()
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = b"\xc1\xff not msgpack at all \x00\x01" * 10
    elif damage == "empty":
        data = b""
    else:
        raw = bytearray(data)
        raw[len(raw) // 2] ^= 0xFF
        data = bytes(raw)
    path.write_bytes(data)
    with pytest.raises(harmony.FormatError):
        LayerGraph.load(d)
    with pytest.raises(harmony.FormatError):
        LayerGraph.load(d, with_code=False)


def test_missing_graph_file_is_refused(tmp_path):
    with pytest.raises(harmony.FormatError):
        LayerGraph.load(tmp_path / "nowhere")
