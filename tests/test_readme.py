"The README is the front page: it must say what nbs/index.ipynb says, and its commands must exist."
import json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_the_index_notebook():
    cells = json.loads((ROOT/'nbs'/'index.ipynb').read_text())['cells']
    index = '\n\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'markdown')
    assert (ROOT/'README.md').read_text().strip() == index.strip(), 'update nbs/index.ipynb and README.md together'


def test_readme_lists_every_notebook():
    readme = (ROOT/'README.md').read_text()
    for nb in sorted((ROOT/'nbs').glob('[0-9][0-9]*_*.ipynb')):
        assert f'`{nb.stem}`' in readme, f'{nb.name} is missing from the README reading list'


def test_ci_runs_the_readme_test_command():
    readme = (ROOT/'README.md').read_text()
    command = re.search(r'^(bash \.ci/setup && .*nbdev_test.*)$', readme, re.M).group(1)
    assert command in (ROOT/'.ci'/'run').read_text()
