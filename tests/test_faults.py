"""Faults a user meets: a training process SIGKILLed at seeded random points (checkpoint writes included) resumes to the
files of a run that never stopped; a damaged log, checkpoint or data file, a missing model and a hub out of reach end in
one `error:` line that names the fix, or are recovered with nothing lost."""
import functools, json, os, queue, random, shutil, signal, subprocess, sys, threading, time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from ragen_nb.checkpoint import latest_checkpoint
from ragen_nb.cli import main, train_main
from ragen_nb.config import RAGEN_ENV_VARS
from ragen_nb.data import curate
from ragen_nb.models import load_tokenizer, tiny_model
from ragen_nb.sokoban import EnvSettings

# the tiny run of test_checkpoint.py's kill-and-resume test, on a small curated dataset, drawing a rollout every step
TINY_RUN = ['TRAIN_BATCH_SIZE=2', 'PPO_BATCH_SIZE=2', 'MICRO_BATCH_SIZE=1', 'MAX_TURNS=2', 'MAX_RESPONSE_LENGTH=6',
            'ACTOR_LR=1e-3', 'CRITIC_LR=1e-3', 'ROLLOUT_ENGINE=hf', 'TOTAL_STEPS=4', 'SAVE_FREQ=1', 'TEST_FREQ=2', 'VAL_ROOMS=2',
            'LOG_IMAGES=True', 'LOG_IMAGE_STEP_SIZE=1', 'LOG_N_IMAGE_PER_BATCH=1']
NO_HUB = 'ragen-nb-tests/no-such-model'   # a valid hub id that no cache holds


@pytest.fixture(autouse=True)
def no_ragen_env(monkeypatch):
    for k in RAGEN_ENV_VARS: monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    "A folder with a tiny random model (model/) and a small curated dataset (rooms/)."
    d, tok = tmp_path_factory.mktemp('tiny'), load_tokenizer()
    tiny_model(tok).save_pretrained(d/'model'); tok.save_pretrained(d/'model')
    curate(d/'rooms', seed=10000, train_size=16, test_size=2, settings=EnvSettings(), tokenizer=tok, progress=False)
    return d


def run_args(tiny, out, name, *extra):
    return [f'BASE_MODEL={tiny/"model"}', f'DATA_DIR={tiny/"rooms"}', f'OUTPUT_DIR={out}', f'EXPERIMENT_NAME={name}',
            f'LOG_IMAGE_DIR={out/"images"}', *TINY_RUN, *extra]


def same(a, b) -> bool:
    "Exact equality of nested checkpoint contents: tensors, arrays, dicts, sequences, plain values."
    if isinstance(a, torch.Tensor): return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray): return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict): return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def assert_same_run(run, reference):
    "The files of `run` equal those of `reference`: metrics (timings aside), rollouts byte for byte, every checkpoint's tensors, optimizer and random states, and the folder's listing."
    untimed = lambda run: [{k: v for k, v in json.loads(l).items() if not k.startswith(('timing/', 'perf/'))}
                           for l in (run/'metrics.jsonl').read_text().splitlines()]
    assert untimed(run) == untimed(reference)
    assert (run/'rollouts.jsonl').read_bytes() == (reference/'rollouts.jsonl').read_bytes()
    listing = lambda run: sorted(str(p.relative_to(run)) for p in run.rglob('*'))
    assert listing(run) == listing(reference)            # no half-written checkpoint or temporary file left behind
    for ckpt in sorted(reference.glob('global_step_*')):
        for f in sorted(ckpt.rglob('*.safetensors')):
            a, b = load_file(f), load_file(run/ckpt.name/f.relative_to(ckpt))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f
        a, b = (torch.load(r/ckpt.name/'state.pt', weights_only=False) for r in (reference, run))
        assert all(same(a[k], b[k]) for k in ('step', 'actor_opt', 'critic_opt', 'rng')), ckpt.name


def one_error_line(err: str, *words):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and 'error:' in lines[0] and 'Traceback' not in err, err
    for w in words: assert w in lines[0], (w, lines[0])
    return lines[0]


# --- a training process killed at random points ------------------------------------------------------------------------

# One training run per line of arguments read from stdin, each in a process forked from this one, which has imported
# the trainer once (importing torch and transformers takes most of a fresh process's start). The run prints where it
# is, so the test can SIGKILL it there: `update N` as step N's update starts, `save N` / `saved N` around its checkpoint,
# and `mid-save N` when the actor of checkpoint N is on disk and the critic and state.pt are not (it waits 0.5 s there).
RUNNER = r'''
import json, os, sys, threading, time, traceback
import ragen_nb.trainer as t, ragen_nb.runlog as runlog, ragen_nb.checkpoint as ckpt, ragen_nb.cli as cli
def mark(text): print(text, flush=True)
real_update, real_save, real_merged, saving = t.ppo_update, runlog.save_checkpoint, ckpt._save_merged, [None]
def ppo_update(*args, **kwargs): mark(f"update {kwargs['step']}"); return real_update(*args, **kwargs)
def save_checkpoint(folder, step, *args, **kwargs):
    saving[0] = step; mark(f'save {step}')
    out = real_save(folder, step, *args, **kwargs); mark(f'saved {step}'); return out
def save_merged(model, path):
    real_merged(model, path)
    if path.name == 'actor': mark(f'mid-save {saving[0]}'); time.sleep(0.5)
# each where it is looked up: the train loop calls ppo_update, RunLog.checkpoint calls save_checkpoint, which calls _save_merged
t.ppo_update, runlog.save_checkpoint, ckpt._save_merged = ppo_update, save_checkpoint, save_merged
mark('ready')
for line in sys.stdin:
    assert threading.active_count() == 1, 'fork only a single-threaded process'
    pid = os.fork()
    if pid == 0:
        code = 1
        try: code = cli.train_main(json.loads(line))
        except BaseException: traceback.print_exc()
        finally: sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
    mark(f'pid {pid}')
    mark(f'exit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}')
'''


class Runner:
    "The RUNNER process; `run` starts one training run and SIGKILLs it where asked."
    def __init__(self, log: Path):
        env = {k: v for k, v in os.environ.items() if k not in RAGEN_ENV_VARS}
        self.log = log.open('w')
        self.proc = subprocess.Popen([sys.executable, '-c', RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next() == 'ready'

    def _read(self):
        for line in self.proc.stdout: self.lines.put(line.strip())
        self.lines.put(None)   # the runner exited

    def next(self) -> str:
        try: line = self.lines.get(timeout=600)
        except queue.Empty: line = None
        if line is None: raise AssertionError(f'the runner died or went quiet: {Path(self.log.name).read_text()[-3000:]}')
        return line

    def run(self, args: list[str], kill_at: str | None = None, delay: float = 0.) -> tuple[int, list[str]]:
        "Exit code of a run of `args` (-9: killed `delay` s after it printed `kill_at`, or after it started for 'pid') and its marks."
        self.proc.stdin.write(json.dumps(args) + '\n'); self.proc.stdin.flush()
        pid, due, marks = None, False, []
        while True:
            line = self.next()
            if line.startswith('exit '): return int(line[5:]), marks
            if line.startswith('pid '): pid = int(line[4:])
            else: marks.append(line)
            due = due or line == kill_at or (kill_at == 'pid' and line.startswith('pid '))
            if due and pid is not None and kill_at is not None:
                time.sleep(delay); kill_at = None
                try: os.kill(pid, signal.SIGKILL)
                except ProcessLookupError: pass   # the run ended during the delay: its exit line follows

    def close(self):
        self.proc.stdin.close(); self.proc.wait(timeout=60); self.log.close()


@pytest.fixture(scope='module')
def runner(tmp_path_factory):
    r = Runner(tmp_path_factory.mktemp('runner')/'stderr.txt')
    yield r
    r.close()


@pytest.fixture(scope='module')
def reference(tiny, runner, tmp_path_factory):
    "The run that never stopped."
    out = tmp_path_factory.mktemp('reference')
    code, marks = runner.run(run_args(tiny, out, 'run'))
    assert code == 0 and [m for m in marks if m.startswith('update')] == [f'update {s}' for s in range(1, 5)]
    return out/'run'


def left(run) -> str:
    "What a killed run left: its newest whole checkpoint, its log lines, a torn last line, half-written checkpoint folders."
    text = (run/'metrics.jsonl').read_text() if (run/'metrics.jsonl').exists() else ''
    ckpt, temp = latest_checkpoint(run), sorted(p.name for p in run.glob('.global_step_*'))
    return (f"{ckpt.name if ckpt else 'no checkpoint'}, {text.count(chr(10))} metrics lines"
            + (' and a torn one' if text and not text.endswith(chr(10)) else '') + (f', half-written {temp}' if temp else ''))


POINTS = [f'{what} {step}' for step in range(1, 5) for what in ('update', 'save', 'mid-save', 'saved')]


def test_sigkill_at_random_points_then_resume_equals_a_run_never_stopped(tiny, runner, reference, tmp_path):
    rng = random.Random(2026)
    run, args = tmp_path/'run', run_args(tiny, tmp_path, 'run')
    # the first kill lands while the run loads its models or validates step 0, at a random time after it starts
    code, _ = runner.run(args, 'pid', rng.uniform(0.5, 4.0))
    kills, resumes, where, last = int(code == -9), 0, [f'start: left {left(run)}'], -1
    assert code == -9
    mid_save_kill = rng.randrange(1, 4)   # which later kill waits for a checkpoint write
    while kills < 5:
        done = int(latest_checkpoint(run).name.rpartition('_')[2]) if latest_checkpoint(run) else 0
        # points the resumed run will pass: after the last kill, and in a step past its checkpoint
        ahead = [i for i in range(last + 1, len(POINTS)) if int(POINTS[i].split()[1]) > done]
        if not ahead: break
        if kills == mid_save_kill: i = next(i for i in ahead if POINTS[i].startswith('mid-save'))
        elif kills == 1: i = rng.choice(ahead[:3])   # after step 0's line, before the first checkpoint: it starts over
        else: i = rng.choice(ahead[:6])
        delay = rng.uniform(0, 0.3) if POINTS[i].startswith('mid-save') else rng.uniform(0, 1.5)
        code, marks = runner.run(args + ['RESUME=True'], POINTS[i], delay)
        resumes += 1
        if code != -9: break   # the delay outlived the run: it finished
        kills, last = kills + 1, i
        where.append(f'{POINTS[i]} +{delay:.2f}s: left {left(run)}')
        if POINTS[i].startswith('mid-save'): assert any(run.glob('.global_step_*')), 'the kill missed the checkpoint write'
    if code == -9: code, _ = runner.run(args + ['RESUME=True']); resumes += 1
    print(f'\nSIGKILLs: {kills}; resumes: {resumes}', *where, sep='\n  ')
    assert code == 0 and kills >= 4 and any(w.startswith('mid-save') for w in where)
    assert_same_run(run, reference)


# --- damaged files --------------------------------------------------------------------------------------------------

def copy_run(reference, tmp_path) -> Path:
    run = tmp_path/'run'
    shutil.copytree(reference, run)
    return run


def cut_metrics(run, keep_until: int, torn: bool):
    "Keep the lines of steps <= `keep_until` in metrics.jsonl and rollouts.jsonl; `torn`: metrics ends with half of the next line."
    lines = (run/'metrics.jsonl').read_text().splitlines(keepends=True)
    kept = [l for l in lines if json.loads(l)['step'] <= keep_until]
    following = lines[len(kept)] if len(kept) < len(lines) else ''
    (run/'metrics.jsonl').write_text(''.join(kept) + (following[:len(following) // 2] if torn else ''))
    rollouts = (run/'rollouts.jsonl').read_text().splitlines(keepends=True)
    (run/'rollouts.jsonl').write_text(''.join(l for l in rollouts if json.loads(l)['step'] <= keep_until))


def test_a_torn_last_line_past_the_checkpoint_is_dropped_and_its_step_redone(tiny, reference, tmp_path, capsys):
    "As a kill while writing step 4's line leaves it: checkpoint 3, and half a line."
    run = copy_run(reference, tmp_path)
    shutil.rmtree(run/'global_step_4'); cut_metrics(run, 3, torn=True)
    assert not (run/'metrics.jsonl').read_text().endswith('\n')
    assert train_main(run_args(tiny, tmp_path, 'run', 'RESUME=True')) == 0
    assert 'resuming' in capsys.readouterr().err
    assert_same_run(run, reference)


def test_a_torn_line_the_checkpoint_covers_is_an_error_and_its_fix_recovers(tiny, reference, tmp_path, capsys):
    run = copy_run(reference, tmp_path)
    cut_metrics(run, 3, torn=True)                                   # checkpoint 4 stays, step 4's line is half gone
    before = {p: p.read_bytes() for p in (run/'metrics.jsonl', run/'rollouts.jsonl')}
    assert train_main(run_args(tiny, tmp_path, 'run', 'RESUME=True')) == 2
    one_error_line(capsys.readouterr().err, 'lacks the lines of steps [4]', 'global_step_4')
    assert all(p.read_bytes() == b for p, b in before.items())      # nothing was rewritten
    shutil.move(run/'global_step_4', tmp_path/'global_step_4')      # the fix the message names
    assert train_main(run_args(tiny, tmp_path, 'run', 'RESUME=True')) == 0
    assert_same_run(run, reference)


def test_garbage_in_the_middle_of_metrics_is_an_error_naming_the_line_and_nothing_changes(tiny, reference, tmp_path, capsys):
    run = copy_run(reference, tmp_path)
    lines = (run/'metrics.jsonl').read_text().splitlines(keepends=True)
    (run/'metrics.jsonl').write_text(''.join(lines[:2] + ['{"step": 2, "score/mean": 0.1\x00\x00 garbage\n'] + lines[2:]))
    before = (run/'metrics.jsonl').read_bytes()
    assert train_main(run_args(tiny, tmp_path, 'run', 'RESUME=True')) == 2
    one_error_line(capsys.readouterr().err, 'metrics.jsonl, line 3,', 'delete that line')
    assert (run/'metrics.jsonl').read_bytes() == before


@pytest.mark.parametrize('damaged', ['state.pt', 'actor/model.safetensors'])
def test_a_checkpoint_cut_short_is_passed_over_for_the_previous_one(tiny, reference, tmp_path, capsys, damaged):
    "The newest checkpoint has a file cut in half (as a disk that filled up, or a copy stopped midway, leaves it)."
    run = copy_run(reference, tmp_path)
    f = run/'global_step_4'/damaged
    f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
    assert latest_checkpoint(run).name == 'global_step_3'
    assert train_main(run_args(tiny, tmp_path, 'run', 'RESUME=True')) == 0
    err = capsys.readouterr().err
    assert 'global_step_4 is not whole' in err and 'cut short' in err and 'resuming' in err and 'global_step_3' in err
    assert_same_run(run, reference)                                   # step 4 redone, its checkpoint written whole again


# --- a user's mistakes: one error line, exit code 2, before any model loads --------------------------------------------

@pytest.fixture
def no_model_loads(monkeypatch):
    "Loading any weights fails the test: the mistake must be found first."
    import transformers
    def boom(*args, **kwargs): raise AssertionError('a model started loading before the mistake was found')
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        monkeypatch.setattr(cls, 'from_pretrained', boom)


@pytest.fixture
def broken_data(tiny, tmp_path):
    "Dataset folders: cut (both parquet files truncated), columns (the room column missing), empty (no files)."
    out = {}
    for name in ('cut', 'columns', 'empty'): out[name] = tmp_path/name; out[name].mkdir()
    for split in ('train', 'test'):
        good = tiny/'rooms'/f'{split}.parquet'
        (out['cut']/f'{split}.parquet').write_bytes(good.read_bytes()[:400])
        pq.write_table(pq.read_table(good).drop_columns(['room']), out['columns']/f'{split}.parquet')
    return out


def command(cmd: str, model: str, data: str | None, tmp_path: Path) -> list[str]:
    "`ragen_nb cmd` with `model` and, for train/eval, the dataset folder `data`."
    if cmd in ('train', 'train-cpu'):
        return [cmd, f'BASE_MODEL={model}', f'OUTPUT_DIR={tmp_path/"runs"}'] + ([f'DATA_DIR={data}'] if data else [])
    if cmd == 'eval': return ['eval', f'MODEL={model}', 'BASE=none', 'N=2'] + ([f'DATA_DIR={data}'] if data else [])
    return ['data', '--model', model, '--output', str(tmp_path/'rooms'), '--train_size', '2', '--test_size', '1']


MODEL_MISTAKES = {'no such folder': ('/nonexistent/model', 'no model folder /nonexistent/model'),
                  'not a model folder': ('{tmp}', 'holds no config.json'),
                  'hub unreachable': (NO_HUB, 'cannot reach the model hub'),
                  'hub offline mode': (NO_HUB, 'HF_HUB_OFFLINE is set')}


@pytest.mark.parametrize('cmd', ['train', 'train-cpu', 'eval', 'data'])
@pytest.mark.parametrize('mistake', list(MODEL_MISTAKES))
def test_a_model_that_cannot_load_is_one_error_line(cmd, mistake, tiny, tmp_path, capsys, monkeypatch, no_model_loads):
    import huggingface_hub, ragen_nb.models
    monkeypatch.chdir(tmp_path)                                        # no data/sokoban here: the default rooms
    model, words = MODEL_MISTAKES[mistake]
    if mistake == 'hub unreachable':   # as without network: the request is refused (a port nobody listens on)
        monkeypatch.setattr(ragen_nb.models, 'model_info',
                            functools.partial(huggingface_hub.HfApi(endpoint='http://127.0.0.1:9').model_info))
    if mistake == 'hub offline mode': monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
    t0 = time.perf_counter()
    assert main(command(cmd, model.format(tmp=tmp_path), None, tmp_path)) == 2
    one_error_line(capsys.readouterr().err, words)
    assert time.perf_counter() - t0 < 60


DATA_MISTAKES = {'cut': 'is not a readable parquet file', 'columns': "lacks columns ['room']",
                 'empty': 'holds no train.parquet or test.parquet', 'typo': 'does not exist'}


@pytest.mark.parametrize('cmd', ['train', 'train-cpu', 'eval'])
@pytest.mark.parametrize('mistake', list(DATA_MISTAKES))
def test_a_dataset_that_cannot_be_read_is_one_error_line(cmd, mistake, tiny, broken_data, tmp_path, capsys, no_model_loads):
    data = str(broken_data[mistake] if mistake != 'typo' else tmp_path/'rooms-with-a-typo')
    assert main(command(cmd, str(tiny/'model'), data, tmp_path)) == 2
    one_error_line(capsys.readouterr().err, DATA_MISTAKES[mistake], f'ragen_nb data --output {data}')


def test_too_few_train_rooms_for_val_rooms_is_one_error_line(tiny, tmp_path, capsys, no_model_loads):
    data = str(tiny/'rooms')                                           # 16 train rooms; validation withholds 64 of them by default
    assert main(command('train', str(tiny/'model'), data, tmp_path)) == 2
    one_error_line(capsys.readouterr().err, 'set VAL_ROOMS below 16', f'ragen_nb data --output {data}')
    from ragen_nb.cli import check_run
    from ragen_nb.config import Config
    check_run(Config.from_args(run_args(tiny, tmp_path, 'no-val', 'VAL_ROOMS=64', 'TEST_FREQ=0')))   # no validation: no rooms withheld


def test_data_into_a_file_is_one_error_line(tiny, tmp_path, capsys):
    (tmp_path/'rooms').write_text('a file')
    assert main(command('data', str(tiny/'model'), None, tmp_path)) == 2
    one_error_line(capsys.readouterr().err, 'is a file')


def test_the_default_data_dir_without_files_says_so_in_one_line(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)                                        # data/sokoban, relative, does not exist here
    from ragen_nb.cli import check_run
    from ragen_nb.config import Config
    from ragen_nb.data import DEFAULT_SPLITS, split_seeds
    from ragen_nb.trainer import room_seeds
    cfg = Config.from_args(run_args(tiny, tmp_path, 'default')[:1] + [f'OUTPUT_DIR={tmp_path}'])
    test = split_seeds(**DEFAULT_SPLITS)['test']
    assert cfg.data_dir == 'data/sokoban' and room_seeds(cfg)['test'] == list(test)
    notes = check_run(cfg)
    assert len(notes) == 1 and 'data/sokoban holds no train.parquet or test.parquet' in notes[0]
    assert f'testing on {test.start}-{test.stop - 1}' in notes[0]
    assert main(['train', f'BASE_MODEL={tiny/"model"}', f'OUTPUT_DIR={tmp_path}', 'DATA_DIR=data/sokoban/']) == 2   # not the default
    one_error_line(capsys.readouterr().err, 'ragen_nb data --output data/sokoban')


def test_a_real_process_prints_one_line_and_no_traceback(tmp_path):
    "The command as a user runs it, with the hub out of reach: no warning, retry or traceback around the error."
    env = {**{k: v for k, v in os.environ.items() if k not in RAGEN_ENV_VARS}, 'HF_ENDPOINT': 'http://127.0.0.1:9',
           'HF_HOME': str(tmp_path/'hf')}
    r = subprocess.run([sys.executable, '-m', 'ragen_nb.cli', 'train', f'BASE_MODEL={NO_HUB}', f'OUTPUT_DIR={tmp_path}'],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stdout == ''
    one_error_line(r.stderr, 'cannot reach the model hub', 'HF_HUB_OFFLINE=1', "'smollm2-135m'")
