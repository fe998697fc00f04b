"""Benchmark, not a test: rooms per second of ragen_nb's generator against gym-sokoban's `generate_room`.

    .venv/bin/python data/bench/bench_rooms.py [N]

Both make N 6x6 one-box rooms (RAGEN's settings) in the same process. ragen_nb's figure includes what it adds:
seeding and restoring both global random states, and its own reverse-play search with `search_depth`; gym-sokoban's
is the bare call on an already seeded state."""
import contextlib, io, random, sys, time
import numpy as np
with contextlib.redirect_stderr(io.StringIO()):
    from gym_sokoban.envs.room_utils import generate_room as gym_generate_room
from ragen_nb.sokoban import EnvSettings, generate_room

n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
settings = EnvSettings(dim_x=6, dim_y=6, num_boxes=1, max_steps=5, search_depth=30)
rows = []
for name, make in [('ragen_nb generate_room (search_depth=30)', lambda s: generate_room(settings, s)),
                   ('ragen_nb generate_room (search_depth=300)', lambda s: generate_room(EnvSettings(search_depth=300), s)),
                   ('gym-sokoban generate_room (ttl 300)', lambda s: gym_generate_room((6, 6), num_steps=20, num_boxes=1))]:
    random.seed(0); np.random.seed(0)
    t0, failures = time.perf_counter(), 0
    for s in range(n):
        try: make(s)
        except (RuntimeError, RuntimeWarning): failures += 1
    rows.append((name, n / (time.perf_counter() - t0), failures))
for name, rate, failures in rows: print(f'{name:42s} {rate:8.0f} rooms/s   ({failures} failures of {n})')
