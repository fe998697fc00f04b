"""`.ci/browser`, the optional part of the set-up, run against a stubbed `apt-get` and `id`: it asks apt only for what is
missing, one package at a time, never fails, and says in one line what is still missing and how to add it."""
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1]/'.ci'/'browser'

def run_browser_setup(tmp_path: Path, have: list[str], uid: int = 0, apt_fails: tuple[str, ...] = ()) -> tuple[int, str, list[str]]:
    "Run .ci/browser with a PATH holding only stubs: the tools in `have`, `id -u` printing `uid`, and an apt-get that logs its calls."
    bin_, log = tmp_path/'bin', tmp_path/'apt.log'
    bin_.mkdir()
    def stub(name, body):
        (bin_/name).write_text(f'#!/bin/bash\n{body}\n'); (bin_/name).chmod(0o755)
    for tool in have: stub(tool, 'exit 0')
    stub('id', f'echo {uid}')
    fails = ' '.join(apt_fails)
    # installing a package named in `fails` exits 100, as apt does for "held broken packages"
    stub('apt-get', f'echo "$*" >> {log}\nfor p in {fails}; do [[ " $* " == *" $p "* ]] && exit 100; done\n'
                    'if [[ " $* " == *" install "* ]]; then for a in "$@"; do case $a in -*|install) ;; *) '
                    f'printf "#!/bin/bash\\nexit 0\\n" > {bin_}/$a; chmod +x {bin_}/$a;; esac; done; fi\nexit 0')
    out = subprocess.run(['/bin/bash', str(SCRIPT)], env={'PATH': str(bin_)}, capture_output=True, text=True)
    calls = log.read_text().splitlines() if log.exists() else []
    return out.returncode, out.stdout + out.stderr, calls

def test_nodesource_machine_gets_chromium_alone(tmp_path):
    "npm already there (NodeSource's nodejs bundles it): apt is asked for chromium only, and nothing is left to say."
    rc, out, calls = run_browser_setup(tmp_path, have=['npm'])
    assert rc == 0 and out == ''
    assert [c for c in calls if 'install' in c] == ['install -y -qq chromium']

def test_apt_refusing_npm_does_not_stop_the_setup(tmp_path):
    "apt refuses npm (exit 100, the NodeSource conflict): chromium still installs, the script exits 0 and names npm."
    rc, out, calls = run_browser_setup(tmp_path, have=[], apt_fails=('npm',))
    assert rc == 0
    installs = [c for c in calls if 'install' in c]
    assert installs == ['install -y -qq chromium', 'install -y -qq npm'], 'one package per apt call'
    assert out.strip().splitlines() == [out.strip()], 'one line'
    assert 'npm not installed' in out and 'apt-get install npm' in out and 'chromium' not in out.split('add with')[1]

def test_no_root_means_no_apt_and_one_line(tmp_path):
    rc, out, calls = run_browser_setup(tmp_path, have=[], uid=1000)
    assert rc == 0 and calls == []
    assert 'chromium npm not installed' in out and 'browser test will skip' in out

def test_nothing_missing_means_no_apt(tmp_path):
    rc, out, calls = run_browser_setup(tmp_path, have=['chromium', 'npm'])
    assert (rc, out, calls) == (0, '', [])
