"Dataset curation from the command line and from Python: determinism, disjoint splits, clear errors."
import copy, subprocess, sys
import pyarrow.parquet as pq
import pytest
from ragen_nb.data import (coordinates_line, curate, first_message, load_split, positions, render_prompt, followup_text,
                           observation_message)
from ragen_nb.models import load_tokenizer
from ragen_nb.sokoban import EnvSettings, SokobanEnv, room_from_text, solve


def test_cli_writes_both_splits(tmp_path):
    out = tmp_path/'sokoban'
    r = subprocess.run([sys.executable, '-m', 'ragen_nb.cli', 'data', '--output', str(out), '--seed', '500',
                        '--train_size', '30', '--test_size', '5', '--prefix', 'qwen-instruct'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    train, test = load_split(out/'train.parquet'), load_split(out/'test.parquet')
    assert [r['seed'] for r in train] == list(range(500, 530))
    assert [r['seed'] for r in test] == list(range(530, 535))


def test_rows_match_the_env_and_the_solver(tmp_path, tok):
    settings = EnvSettings(search_depth=10)
    rows = load_split(curate(tmp_path, seed=7, train_size=20, test_size=0, tokenizer=tok, settings=settings,
                             progress=False)['train'], settings)
    env = SokobanEnv(settings)
    for row in rows:
        assert env.reset(row['seed']) == row['room']            # the row's room is the env's room for that seed
        plan = solve(*room_from_text(row['room']))
        assert row['solution_length'] == len(plan)
        assert row['room'] in row['prompt']


def test_same_arguments_same_bytes(tmp_path, tok):
    a = curate(tmp_path/'a', seed=3, train_size=15, test_size=3, tokenizer=tok, progress=False)
    b = curate(tmp_path/'b', seed=3, train_size=15, test_size=3, tokenizer=tok, progress=False)
    for split in a: assert a[split].read_bytes() == b[split].read_bytes()


def test_bad_files_and_arguments(tmp_path, tok):
    paths = curate(tmp_path, seed=1, train_size=4, test_size=1, tokenizer=tok, progress=False)
    with pytest.raises(FileNotFoundError, match='ragen_nb data'): load_split(tmp_path/'missing.parquet')
    table = pq.read_table(paths['train']).drop_columns(['room'])
    pq.write_table(table, tmp_path/'no_room.parquet')
    with pytest.raises(ValueError, match=r"lacks columns \['room'\]"): load_split(tmp_path/'no_room.parquet')
    (tmp_path/'cut.parquet').write_bytes(paths['train'].read_bytes()[:100])
    with pytest.raises(ValueError, match='not a readable parquet'): load_split(tmp_path/'cut.parquet')
    with pytest.raises(ValueError, match='num_boxes'): load_split(paths['train'], EnvSettings(num_boxes=2))
    with pytest.raises(ValueError, match='prefix'): curate(tmp_path, prefix='chatml', tokenizer=tok)


def test_followup_continues_the_chat_template(tok):
    "Prompt + reply + eos + follow-up equals the template's own rendering of the whole chat."
    room, reply = '#####\n#P_O#\n#####', '<answer>Up</answer>'
    message = observation_message(room, reward=-0.1)
    turn_by_turn = render_prompt(tok, room, prefilled=False) + reply + tok.eos_token + followup_text(tok, message, prefilled=False)
    from ragen_nb.data import first_message
    whole = tok.apply_chat_template([{'role': 'user', 'content': first_message(room)},
                                     {'role': 'assistant', 'content': reply},
                                     {'role': 'user', 'content': message}], add_generation_prompt=True, tokenize=False)
    assert turn_by_turn == whole


def test_a_wrong_eos_is_refused_with_the_fix(tok):
    "An eos the chat template never writes (transformers 5.17 converted the embedded GGUF with '<|im_start|>') names both fixes."
    wrong = copy.deepcopy(tok)
    wrong.eos_token = '<|im_start|>'
    assert wrong.eos_token == '<|im_start|>' and tok.eos_token == '<|im_end|>'
    with pytest.raises(ValueError, match="'<\\|im_start\\|>'.*upgrade transformers.*template='base'"):
        followup_text(wrong, 'next')
    assert followup_text(tok, 'next').startswith('\n<|im_start|>user')   # the right eos passes


def test_wrong_types_and_empty_cells_are_refused_naming_the_folder(tmp_path, tok):
    import pyarrow as pa
    paths = curate(tmp_path, seed=1, train_size=3, test_size=1, tokenizer=tok, progress=False)
    table = pq.read_table(paths['train'])
    fix = f'ragen_nb data --output {tmp_path}'                       # the message names this folder, not a placeholder
    pq.write_table(table.set_column(1, 'seed', pa.array(['one', 'two', 'three'])), tmp_path/'types.parquet')
    with pytest.raises(ValueError, match=f'wrong type.*{fix}'): load_split(tmp_path/'types.parquet')
    pq.write_table(table.set_column(7, 'room', pa.array([None, 'x', 'y'], pa.string())), tmp_path/'empty.parquet')
    with pytest.raises(ValueError, match=r"empty cells in columns \['room'\]"): load_split(tmp_path/'empty.parquet')
    pq.write_table(table.set_column(1, 'seed', pa.array([1, 2, 3], pa.int32())), tmp_path/'int32.parquet')
    assert [r['seed'] for r in load_split(tmp_path/'int32.parquet')] == [1, 2, 3]   # a safe cast is fine
    with pytest.raises(FileNotFoundError, match=fix): load_split(tmp_path/'absent.parquet')
    (tmp_path/'file').write_text('')
    with pytest.raises(NotADirectoryError, match='is a file'): curate(tmp_path/'file', train_size=1, test_size=1, tokenizer=tok)


def test_coordinates_are_the_cells_of_the_drawing():
    "Two boxes, one on its target: every box and every target is listed, as (row, column) read off the drawing by hand."
    room = '######\n#P_X_#\n#_√O_#\n######'
    assert positions(room) == {'you': [(1, 1)], 'boxes': [(1, 3), (2, 2)], 'targets': [(2, 2), (2, 3)]}
    assert coordinates_line(room) == ('Positions as (row, column), (0, 0) at the top left: '
                                      'you (1, 1); boxes (1, 3) (2, 2); targets (2, 2) (2, 3).')
    with_line = f'{room}\n{coordinates_line(room)}'   # the line sits right under the drawing; nothing else changes
    assert first_message(room, coordinates=True) == first_message(room).replace(room, with_line)
    assert observation_message(room, -0.1, coordinates=True) == observation_message(room, -0.1).replace(room, with_line)
    for seed in range(20):   # a wall row above and a wall column on the left move every position by (1, 1)
        room = SokobanEnv().reset(seed=seed)
        shifted = '\n'.join(['#' * (room.index('\n') + 1)] + ['#' + row for row in room.splitlines()])
        assert positions(shifted) == {k: [(r + 1, c + 1) for r, c in v] for k, v in positions(room).items()}
