import pytest

from swarmtrain.dht import Blacklist, BlacklistStatistics


def test_bans_grow_and_an_answer_does_not_lift_them():
    blacklist: Blacklist[str] = Blacklist(blacklist_time=5.0, backoff_rate=2.0, max_ban_time=15.0)
    assert not blacklist.is_banned("peer", now=0.0)
    assert blacklist.register_failure("peer", now=0.0) == 5.0
    assert blacklist.is_banned("peer", now=4.9) and not blacklist.is_banned("peer", now=5.0)
    assert blacklist.register_failure("peer", now=2.0) == 5.0  # concurrent failure: same ban
    assert blacklist.register_failure("peer", now=6.0) == 16.0  # 5 * 2
    assert blacklist.register_failure("peer", now=17.0) == 32.0  # 5 * 4 capped at 15
    assert blacklist.statistics(now=20.0) == BlacklistStatistics(1, 1, 0)
    # an answer (from a call sent before the ban) lifts a backoff, never a ban
    blacklist.register_success("peer")
    assert blacklist.is_banned("peer", now=20.0) and not blacklist.is_backed_off("peer", 20.0)
    assert blacklist.register_failure("peer", now=32.0) == 47.0  # still escalating: 15 (cap)


def test_quiet_period_forgives_and_frees_memory():
    blacklist: Blacklist[int] = Blacklist(blacklist_time=1.0, backoff_rate=3.0)
    assert blacklist.register_failure(1, now=0.0) == 1.0
    assert blacklist.register_failure(1, now=1.5) == 4.5  # within the quiet period: backoff
    assert blacklist.statistics(now=100.0) == BlacklistStatistics(0, 0)
    assert blacklist.register_failure(1, now=100.0) == 101.0


def test_unresponsive_peers_are_backed_off_briefly_and_an_answer_lifts_it():
    blacklist: Blacklist[str] = Blacklist(1.0, backoff_rate=2.0, max_backoff_time=3.0)
    assert blacklist.register_unresponsive("slow", now=0.0) == 1.0
    assert blacklist.is_backed_off("slow", now=0.5) and not blacklist.is_banned("slow", now=0.5)
    assert blacklist.register_unresponsive("slow", now=0.5) == 1.0  # concurrent: same backoff
    assert blacklist.register_unresponsive("slow", now=1.0) == 3.0  # 1 * 2
    assert blacklist.register_unresponsive("slow", now=3.0) == 6.0  # 1 * 4 capped at 3
    assert blacklist.statistics(now=4.0) == BlacklistStatistics(0, 0, 1)
    blacklist.register_success("slow")  # it answered or called us
    assert not blacklist.is_backed_off("slow", now=4.0)
    assert blacklist.register_unresponsive("slow", now=4.0) == 5.0  # back to the base time
    # bans and backoffs are counted apart
    assert blacklist.register_failure("slow", now=4.0) == 5.0
    assert blacklist.statistics(now=4.5) == BlacklistStatistics(1, 1, 1)


def test_disabled_and_invalid():
    blacklist: Blacklist[str] = Blacklist(blacklist_time=0.0)
    assert blacklist.register_failure("p", now=1.0) == 1.0
    assert blacklist.register_unresponsive("p", now=1.0) == 1.0
    assert not blacklist.is_banned("p", now=1.0) and not blacklist.is_backed_off("p", now=1.0)
    for kwargs in (
        {"blacklist_time": -1},
        {"backoff_rate": 0.5},
        {"max_ban_time": 1.0},
        {"max_backoff_time": -1.0},
    ):
        with pytest.raises(ValueError):
            Blacklist(**kwargs)
