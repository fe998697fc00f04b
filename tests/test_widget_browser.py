"""The trajectory widget saved as a standalone page (ipywidgets embed) and driven in headless Chromium: it renders the board
and the tokens, and moving the turn slider changes both, with no Python kernel behind the page.

Needs: Chromium at /usr/bin/chromium (or on PATH), the `playwright` Python package (never `playwright install`: we use the
system Chromium), and the widget JavaScript `@jupyter-widgets/html-manager` from npm (fetched once with `npm pack` into
~/.cache/ragen_nb, or pointed to with RAGEN_NB_WIDGET_JS=/path/to/dist). Saves tests/artifacts/widget.png."""
import importlib.util, os, shutil, subprocess, tarfile
from pathlib import Path
import pytest
from ragen_nb.models import load_tokenizer
from ragen_nb.rollout import rollout, ScriptedEngine, RolloutConfig
from ragen_nb.sokoban import EnvSettings, SokobanEnv, room_from_text, solve, ACTIONS
from ragen_nb.viz import find_room
from ragen_nb.widget import TrajectoryWidget

HTML_MANAGER = '@jupyter-widgets/html-manager@1.0.15'   # the embed bundle matching ipywidgets 8 (html-manager ^1.0)
ARTIFACT = Path(__file__).parent/'artifacts'/'widget.png'
CACHE = Path.home()/'.cache'/'ragen_nb'/HTML_MANAGER.replace('/', '_').replace('@', '')
CHROMIUM = shutil.which('chromium') or ('/usr/bin/chromium' if Path('/usr/bin/chromium').exists() else None)

def _skip_reasons() -> list[str]:
    reasons = [] if CHROMIUM else ['no chromium (apt-get install -y chromium)']
    if importlib.util.find_spec('playwright') is None: reasons.append('no playwright (pip install playwright; never run `playwright install`)')
    if not (os.environ.get('RAGEN_NB_WIDGET_JS') or (CACHE/'package'/'dist'/'embed.js').exists() or shutil.which('npm')):
        reasons.append(f'no npm to fetch {HTML_MANAGER} once (apt-get install npm, or set RAGEN_NB_WIDGET_JS to its dist folder)')
    return reasons

pytestmark = pytest.mark.skipif(bool(_skip_reasons()), reason='; '.join(_skip_reasons()))

def embed_js() -> Path:
    "The html-manager's dist/embed.js: from RAGEN_NB_WIDGET_JS, else the cache, else `npm pack` into the cache."
    if os.environ.get('RAGEN_NB_WIDGET_JS'): return Path(os.environ['RAGEN_NB_WIDGET_JS'])/'embed.js'
    cache, dist = CACHE, CACHE/'package'/'dist'
    if not (dist/'embed.js').exists():
        cache.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(['npm', 'pack', HTML_MANAGER, '--silent'], cwd=cache, capture_output=True, text=True, timeout=300)
        if out.returncode: pytest.fail(f'npm pack {HTML_MANAGER} failed: {out.stderr[-500:]}')
        with tarfile.open(cache/out.stdout.strip().splitlines()[-1]) as tar: tar.extractall(cache, filter='data')
    return dist/'embed.js'

def oracle(context: str) -> str:
    "The solver's first move on the latest room in the context, so every turn changes the board."
    return f'{ACTIONS[solve(*room_from_text(find_room(context.rsplit("<|im_start|>user", 1)[1])))[0]]}</answer>'

def page_file(folder: Path) -> Path:
    "The widget over two scripted 3-turn episodes on rooms that need at least 3 moves, saved with a local embed.js."
    tok, settings = load_tokenizer(), EnvSettings()
    seeds = [s for s in range(100) if len(solve(*room_from_text(SokobanEnv(settings).reset(seed=s)))) >= 3][:2]
    trajs = rollout(ScriptedEngine(tok, oracle), tok, seeds, settings, RolloutConfig(max_turns=3, max_response_length=20))
    assert all(len(t.actions) >= 2 for t in trajs), 'the test needs two turns in each trajectory'
    stats = {'advantage': [[float(k % 7) - 3 for k in range(len(t))] for t in trajs]}
    return TrajectoryWidget(trajs, tok, token_stats=stats).save_html(folder/'widget.html', embed_url=embed_js().as_uri())

def _visible(page) -> dict:
    "What the shown turn displays: each board as pixels (element screenshots) and the token texts and kinds."
    images = page.locator('img.widget-image:visible')
    tokens = page.locator('.tok:visible')
    return dict(boards=[images.nth(k).screenshot() for k in range(images.count())],
                tokens=tokens.all_inner_texts(), kinds=[c.split()[1] for c in tokens.evaluate_all('els => els.map(e => e.className)')],
                legend=page.locator('.token-strip:visible > div').first.inner_text())

def test_widget_in_headless_chromium(tmp_path_factory):
    from playwright.sync_api import sync_playwright
    path = page_file(tmp_path_factory.mktemp('widget'))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=['--no-sandbox', '--headless', '--disable-gpu'])
        try:
            page = browser.new_page(viewport={'width': 1100, 'height': 900})
            errors = []
            page.on('pageerror', lambda e: errors.append(str(e)))
            page.goto(path.as_uri())
            page.wait_for_selector('img.widget-image', timeout=30_000)
            turn0 = _visible(page)
            assert len(turn0['boards']) == 1 and set(turn0['kinds']) == {'tok-prompt'} and len(turn0['tokens']) > 50

            page.locator('.noUi-handle:visible').first.focus()
            page.keyboard.press('ArrowRight'); page.wait_for_timeout(300)
            turn1 = _visible(page)
            assert len(turn1['boards']) == 2 and turn1['boards'][0] == turn0['boards'][0]   # before turn 1 = the start room
            assert turn1['boards'][1] != turn1['boards'][0]                                  # the move changed the board
            assert 'tok-LLM' in turn1['kinds'] and 'tok-prompt' not in turn1['kinds'] and turn1['tokens'] != turn0['tokens']

            page.keyboard.press('ArrowRight'); page.wait_for_timeout(300)
            turn2 = _visible(page)
            assert turn2['boards'][0] == turn1['boards'][1] and turn2['tokens'] != turn1['tokens']   # turns chain

            page.get_by_role('button', name='advantage').click(); page.wait_for_timeout(300)
            assert _visible(page)['legend'].startswith('LLM tokens by advantage')
            page.locator('.noUi-handle:visible').first.focus()       # the click moved the focus to the toggle
            page.keyboard.press('ArrowLeft'); page.wait_for_timeout(300)
            assert _visible(page)['tokens'] == turn1['tokens']

            ARTIFACT.parent.mkdir(exist_ok=True)
            page.get_by_role('button', name='source').click(); page.wait_for_timeout(300)
            page.screenshot(path=str(ARTIFACT), full_page=True)

            page.locator('select').select_option(index=1); page.wait_for_timeout(300)
            assert _visible(page)['boards'][0] != turn0['boards'][0]     # trajectory 2 starts at its own turn 0, another room
            assert not errors, errors
        finally: browser.close()
