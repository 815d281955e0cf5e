"""The coordinator chooses what each site receives: share routing and split views (review findings 1).

A site masks against EVERY other site of the job, so the coordinator cannot pick a victim's peers; what split
views at the unmask stage can still decode is what ``honest_shares`` counts (a lower bound)."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from feta_release.accountants.skellam import honest_shares
from feta_release.federation import secagg as sa


def _round(n: int, t: int, rid: str) -> tuple[sa.RoundConfig, dict[int, sa.SecAggSite]]:
    ids = tuple(range(1, n + 1))
    keys = {i: Ed25519PrivateKey.generate() for i in ids}
    verify = sa.ed25519_verifier({i: k.public_key() for i, k in keys.items()})
    cfg = sa.RoundConfig(rid, ids, t, 8, 32)
    return cfg, {i: sa.SecAggSite(i, cfg, sa.ed25519_signer(keys[i]), verify) for i in ids}


def _x(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 1000, 8).astype(np.uint64)


@pytest.mark.parametrize(("n", "t"), [(5, 3), (7, 4), (9, 5)])
def test_a_victim_given_the_shares_of_only_t_minus_1_peers_refuses_to_mask(n: int, t: int) -> None:
    """0 colluders: the victim gets the shares of t - 1 peers P only, every other site
    is told 'victim alive, P dropped'; on the old code the victim masked against P alone and its vector came
    out with only its own noise share (t seed shares of it, t key shares of each peer in P)."""
    cfg, sites = _round(n, t, f"route{n}")
    adverts = {i: s.setup() for i, s in sites.items()}
    cts = {i: s.share_keys(adverts) for i, s in sites.items()}
    victim, peers = 1, cfg.node_ids[1:t]
    with pytest.raises(sa.SecAggError, match="every other site of the key setup"):
        sites[victim].masked_vector({j: cts[j][victim] for j in peers}, _x(victim))
    # the complete routing is accepted
    sites[2].masked_vector({j: cts[j][2] for j in cfg.node_ids if j != 2}, _x(2))


def test_a_victim_given_a_key_broadcast_of_only_t_sites_refuses_it() -> None:
    """The same routing one stage earlier: a key broadcast naming t sites would make the victim share and mask
    with those only."""
    cfg, sites = _round(5, 3, "keysplit")
    adverts = {i: s.setup() for i, s in sites.items()}
    with pytest.raises(sa.SecAggError, match=r"keys of sites \[4, 5\] are missing"):
        sites[1].share_keys({i: adverts[i] for i in (1, 2, 3)})


def test_the_coordinator_redoes_a_setup_a_site_left_without_charging() -> None:
    """A site that sends no key advert, or not a share for every other site, ends the round before any
    masking: the coordinator raises SetupIncomplete (secure_collect redoes the round under a new round id)."""
    cfg, sites = _round(3, 2, "incomplete")
    co = sa.SecAggCoordinator(cfg)
    adverts = {i: s.setup() for i, s in sites.items()}
    with pytest.raises(sa.SetupIncomplete, match=r"site\(s\) \[3\]"):
        co.collect_keys({i: adverts[i] for i in (1, 2)})
    keys = co.collect_keys(adverts)
    replies = {i: s.share_keys(keys) for i, s in sites.items()}
    replies[3] = {1: replies[3][1]}  # site 3 left mid-way
    with pytest.raises(sa.SetupIncomplete, match="did not share"):
        co.route_shares(replies)


def test_a_split_view_decodes_two_sites_of_five_at_threshold_three() -> None:
    """Unmask-stage split view, 0 colluders, (n, t) = (5, 3), every site masking against all: the coordinator
    gets x1 + x2 (two noise shares, not t = 3) from requests that each pass every check. ``honest_shares``
    must not count more than 2 (it counted 3 before)."""
    cfg, sites = _round(5, 3, "split2")
    adverts = {i: s.setup() for i, s in sites.items()}
    cts = {i: s.share_keys(adverts) for i, s in sites.items()}
    masked = {
        i: s.masked_vector({j: cts[j][i] for j in cfg.node_ids if j != i}, _x(i)) for i, s in sites.items()
    }
    views = {
        1: ([1, 2, 3], [4, 5]),
        2: ([1, 2, 4], [3, 5]),
        3: ([3, 1, 2], [4, 5]),
        4: ([4, 1, 2], [3, 5]),
        5: ([5, 1, 2], [3, 4]),
    }
    out = {i: sites[i].unmask(*views[i]) for i in cfg.node_ids}
    total = (masked[1] + masked[2]) & cfg.mask
    for s in (1, 2):
        seed = sa.combine_shares([out[k][s] for k in cfg.node_ids if s in views[k][0]][:3])
        total = (total - sa.prg_mask(seed, cfg, 0)) & cfg.mask
    for j in (3, 4, 5):
        sk1 = sa.combine_shares([out[k][j] for k in cfg.node_ids if j in views[k][1]][:3])
        for s in (1, 2):
            total = (total - sa.pairwise_mask(sa._pair_key(sk1, adverts[s][0]), s, j, cfg, 0)) & cfg.mask
    np.testing.assert_array_equal(total, (_x(1) + _x(2)) & cfg.mask)
    assert honest_shares(5, 3, 0) <= 2


@pytest.mark.parametrize(
    ("n", "t", "c"), [(n, t, c) for n in range(2, 10) for t in range(n // 2 + 1, n + 1) for c in range(n)]
)
def test_honest_shares_is_between_one_and_threshold_minus_colluders(n: int, t: int, c: int) -> None:
    h = honest_shares(n, t, c)
    assert 1 <= h <= max(1, t - c)
    assert (h == 1) or 2 * (t - c) > n - c
    if t == n:  # every site in every sum: no site can be called dropped, all honest shares count
        assert h == n - c


def test_the_node_checks_key_adverts_against_its_pinned_peers_not_the_relay() -> None:
    """The coordinator relayed the site keys that authenticate key adverts, so it could relay
    its own key under another site's id (or a sybil site's) and read the victim's Shamir shares. The node now
    takes the keys its admin-signed policy pins (``secure_aggregation.peers``)."""
    from types import SimpleNamespace

    from edge.secure import _advert_keys
    from feta_release.errors import PolicyError
    from feta_release.policy.document import SitePolicy
    from feta_release.signing import public_key_pem
    from tests.support.policy import keys, policy_doc

    own, b, c, evil = (Ed25519PrivateKey.generate() for _ in range(4))
    pins = {"site-b": public_key_pem(b.public_key()), "site-c": public_key_pem(c.public_key())}
    pol = SitePolicy.from_document(policy_doc(keys(), secure_aggregation={"peers": pins}), None)
    site = SimpleNamespace(site_id=pol.site_id, key=own, policy=pol)
    job = SimpleNamespace(sites=[pol.site_id, "site-b", "site-c"])
    nodes = {pol.site_id: 1, "site-b": 2, "site-c": 3}
    relay = {"1": public_key_pem(own), "2": pins["site-b"], "3": public_key_pem(evil.public_key())}
    with pytest.raises(PolicyError, match=r"secure_aggregation\.peers.*site-c"):
        _advert_keys(site, job, {"site_keys": relay, "nodes": nodes}, 1)  # type: ignore[arg-type]
    relay.pop("3")  # no relayed key: the pinned one is used anyway
    assert _advert_keys(site, job, {"site_keys": relay, "nodes": nodes}, 1) == {  # type: ignore[arg-type]
        "1": public_key_pem(own),
        "2": pins["site-b"],
        "3": pins["site-c"],
    }
    sybil = SimpleNamespace(sites=[pol.site_id, "site-b", "site-c", "sybil-1"])
    with pytest.raises(PolicyError, match=r"secure_aggregation\.peers.*sybil-1"):
        _advert_keys(site, sybil, {"site_keys": relay, "nodes": {**nodes, "sybil-1": 4}}, 1)  # type: ignore[arg-type]
