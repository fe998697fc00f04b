"Fixtures the test files share: the embedded model's tokenizer, and a tiny random model saved as a folder."
import pytest
from ragen_nb.models import load_tokenizer, tiny_model


@pytest.fixture(scope='session')
def tok():
    "The embedded SmolLM2's tokenizer: its chat template, special tokens and eos, as every real run sees them."
    return load_tokenizer()


@pytest.fixture(scope='session')
def tiny_dir(tok, tmp_path_factory):
    "A tiny random Llama with the embedded tokenizer, saved as a folder that BASE_MODEL or MODEL can name: it loads in a second and never answers with an action."
    d = tmp_path_factory.mktemp('tiny')
    tiny_model(tok).save_pretrained(d); tok.save_pretrained(d)
    return d


def pytest_configure(config):
    config.addinivalue_line('markers', "slow: a test that takes tens of seconds or minutes (whole runs, several processes, the real model's "
                                       "rollouts, the main job's replay); `pytest -m 'not slow' tests/` leaves them out while you work, CI runs them all")
