"The course reads in order: no notebook uses a module that a later notebook teaches, and every module is taught by one notebook."
import json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT/'nbs').glob('[0-9][0-9]*_*.ipynb'))   # 09a_stats sits between 09_ppo and 10_evaluate

def number(nb: Path) -> str:
    "A notebook's place in the course, '09' < '09a' < '10': the part of its name before the first _."
    return nb.name.split('_')[0]

def code(nb: Path) -> str:
    return '\n'.join(''.join(c['source']) for c in json.loads(nb.read_text())['cells'] if c['cell_type'] == 'code')

def taught() -> dict[str, str]:
    "Module name -> `number` of the notebook that exports it (its `#| default_exp`)."
    out = {}
    for nb in NOTEBOOKS:
        m = re.search(r'^#\|\s*default_exp\s+(\w+)', code(nb), re.M)
        if m:
            assert m.group(1) not in out, f'{m.group(1)} is exported by two notebooks'
            out[m.group(1)] = number(nb)
    return out

def used(nb: Path) -> set[str]:
    "The ragen_nb modules a notebook's cells import."
    text = code(nb)
    names = set(re.findall(r'\bfrom ragen_nb\.(\w+) import', text)) | set(re.findall(r'\bimport ragen_nb\.(\w+)', text))
    return names | set(re.findall(r'\bfrom ragen_nb import (\w+)', text))

def test_every_library_module_is_taught_by_a_notebook():
    modules = {p.stem for p in (ROOT/'ragen_nb').glob('*.py') if not p.stem.startswith('_')}
    assert modules == set(taught()), f'modules without a notebook: {modules - set(taught())}; notebooks without a module: {set(taught()) - modules}'

def test_no_notebook_uses_a_later_notebooks_module():
    where, late = taught(), []
    for nb in NOTEBOOKS:
        me = number(nb)
        late += [f'{nb.name} uses ragen_nb.{m}, taught in notebook {where[m]}' for m in sorted(used(nb)) if where.get(m, '') > me]
    assert not late, '\n'.join(late)

def test_the_check_catches_a_late_import(tmp_path):
    "The rule above is not vacuous: a notebook importing a later module is found."
    nb = NOTEBOOKS[0]
    cells = json.loads(nb.read_text())
    cells['cells'].append(dict(cell_type='code', source=['from ragen_nb.trainer import train'], metadata={}, outputs=[], execution_count=None))
    fake = tmp_path/nb.name; fake.write_text(json.dumps(cells))
    assert 'trainer' in used(fake) and taught()['trainer'] > number(fake)

def outputs(nb: Path) -> list[str]:
    "The text of every stored output of a notebook (streams, results, errors; images left out)."
    out = []
    for c in json.loads(nb.read_text())['cells']:
        for o in c.get('outputs', []) if c['cell_type'] == 'code' else []:
            if 'text' in o: out.append(''.join(o['text']))
            out += [''.join(v) for k, v in o.get('data', {}).items() if k.startswith('text/')]
            out += o.get('traceback', [])
    return out

def test_every_notebook_keeps_its_outputs():
    "The prose states results that the stored outputs show: a notebook saved without them (nbdev_clean with clear_all) would hide them."
    empty = [nb.name for nb in NOTEBOOKS if not outputs(nb)]
    assert not empty, f'notebooks with no stored outputs (run them and save): {empty}'

def test_stored_outputs_name_no_path_of_the_machine():
    found = [f'{nb.name}: {m.group(0)}' for nb in NOTEBOOKS for text in outputs(nb)
             for m in re.finditer(r'/(?:tmp|work|home|root|Users)/\S*', text)]
    assert not found, 'stored outputs that name a path of the machine they ran on:\n' + '\n'.join(found[:20])

QUIET = re.compile(r'^(test_\w*|assert\w*|show_doc|plt\.\w+|fig\.\w+|ax\.\w+|hf_logging\.\w+|shutil\.rmtree|\w+\.(append|extend|update|clear|unlink|mkdir|'
                   r'write_text|savefig|save_pretrained|step|backward|zero_grad|train|eval|close))$')

def silent_cells(nb: Path) -> list[str]:
    "Code cells that end on a value a reader should see (an expression or a print, not a check or a plot call) yet store no output. Cells flagged `#| gpu` cannot run on a CPU machine and are left out; exported cells end on definitions."
    import ast
    out = []
    for i, c in enumerate(json.loads(nb.read_text())['cells']):
        src = ''.join(c['source'])
        if c['cell_type'] != 'code' or c.get('outputs') or re.search(r'^#\|\s*(export\w*|hide|gpu)\b', src, re.M): continue
        try: tree = ast.parse('\n'.join(l for l in src.splitlines() if not l.lstrip().startswith(('#|', '%', '!'))))
        except SyntaxError: continue
        last = tree.body[-1] if tree.body else None
        if not isinstance(last, ast.Expr) or (isinstance(last.value, ast.Call) and QUIET.match(ast.unparse(last.value.func))): continue
        out.append(f'{nb.name}[{i}] ends on {ast.unparse(last.value)[:40]}')
    return out

def test_every_cell_that_ends_on_a_value_shows_it():
    "A cell that ends on a value is there to show it: stored without its output (edited and not re-run, or skipped), the prose around it points at nothing."
    found = [s for nb in NOTEBOOKS for s in silent_cells(nb)]
    assert not found, 'cells that end on a value but store no output (run the notebook and save it):\n' + '\n'.join(found)

def test_the_silent_cell_check_finds_one(tmp_path):
    "The rule is not vacuous: a cell ending on a name with no output is found, one with its output, or ending on a check, is not."
    cell = lambda src, outputs=(): dict(cell_type='code', source=[src], metadata={}, outputs=list(outputs), execution_count=None)
    nb = dict(cells=[cell('x = 1\nx'), cell('x', [dict(output_type='execute_result', data={'text/plain': ['1']})]), cell('test_eq(1, 1)'),
                     cell('#| gpu\nx')], metadata={}, nbformat=4, nbformat_minor=5)
    fake = tmp_path/'99_fake.ipynb'; fake.write_text(json.dumps(nb))
    assert silent_cells(fake) == ['99_fake.ipynb[0] ends on x']
