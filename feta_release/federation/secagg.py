"""Secure summation of the sites' Skellam contributions (SecAgg / SecAgg+ of Bonawitz et al. 2017 and Bell et
al. 2020, the protocol Flower's ``secaggplus_mod`` / ``SecAggPlusWorkflow`` implement), as message-level
logic: one
:class:`SecAggSite` per site, one :class:`SecAggCoordinator`, four stages (Flower's ``Stage``: setup,
share_keys, collect_masked_vectors, unmask).  The coordinator learns only the sum mod m of the vectors of the
sites that reached the masking stage; no single vector.

Flower's primitives are used as they are: ECDH key pairs (``flwr.supercore.primitives.asymmetric``,
SECP384R1), the HKDF-derived shared keys and Fernet encryption of the shares (``secure_aggregation.crypto.
symmetric_encryption``), Shamir secret sharing (``secure_aggregation.crypto.shamir``, pycryptodome) and the
share plaintext layout (``secaggplus_utils``).  Flower's protocol STAGES are re-wired here, because:
  * Flower's SecAgg+ runs only through the legacy compat layer (DefaultWorkflow + NumPyClient +
    secaggplus_mod, on train messages), while the node answers signed job requests on its own message types
    and must run its trust checks (signed job, policy, ledger) before any byte leaves the site;
  * its quantization (clip + stochastic rounding, no noise) is not the Skellam mechanism: the vector masked
    here is the site's Skellam contribution (per-record conditional rounding + its noise share), already mod
    m;
  * its mask expansion ``pseudo_rand_gen`` folds the 256-bit seed to a 32-bit seed of numpy's Mersenne Twister
    (2^32 seeds can be searched, and MT19937's output is predictable) and draws ``randint(0, m - 1)``, which
    never yields m - 1 (masked values are not uniform).  Masks here are the ChaCha20 keystream
    (``cryptography``) under the 256-bit seed / shared key, read as uint64 and reduced mod m = 2^b: exactly
    uniform, cryptographic.

Trust model.  Every key advertisement is signed with the site's long-term Ed25519 key and checked against the
job's site keys (``sign`` / ``verify`` are required), so a coordinator cannot substitute keys.  A site
reveals, per other site, EITHER the share of its mask seed (alive) OR of its mask key (dropped), never both,
in one sum and across the sums of one key setup; it answers one unmask request per sum; below the threshold it
refuses.  A key setup serves several sums only while each unmask request calls every site alive: the first sum
with a dropout in a site's view is the setup's last at that site, so every sum is masked against every other
site and no mask key is revealed before a later sum (the one-sum bound below holds for each sum).

Every site masks against EVERY other site of the job: it refuses a key broadcast without all of them and a
collect whose shares do not come from all of them (a coordinator that chose whose shares a site receives could
give a victim the shares of t - 1 peers only, call those peers dropped to everyone else and remove every mask
on the victim's vector, with no colluder).  A site that leaves before masking ends the round
(``SetupIncomplete``): nothing was masked or charged, and the coordinator redoes it under a new round id.

What that guarantees: against an honest-but-curious coordinator (it sends every site the same view), no vector
is unmasked alone.  Against a coordinator that lies, with ``c`` colluding sites, nothing checks that all sites
got the same alive/dropped view: it can tell one group of honest sites (the victim among them) that the victim
is alive and another group that it dropped, and the colluders answer both.  The victim's vector comes out
alone iff 2 (t - c) <= n - c; otherwise sums over fewer than t - c honest sites can still decode (n = 5, t =
3, c = 0: two sites).  The consistency check of Bonawitz et al. (each site signs the alive set and reveals
only after t signatures on it) does not raise this bound, because each honest site already answers a single
request per sum.
:func:`feta_release.accountants.skellam.honest_shares` derives the fewest honest shares such views can reach,
and the sites count only those.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import Stage
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from ..errors import PrivacyError

STAGES = Stage.all()  # setup, share_keys, collect_masked_vectors, unmask

Signer = Callable[[bytes], bytes]
Verifier = Callable[[int, bytes, bytes], bool]  # (node id, message, signature) -> valid
KeyAdvert = tuple[bytes, bytes, bytes]  # (pk1, pk2, the site's signature of key_advert)


class SecAggError(PrivacyError):
    """A secure-aggregation round is refused (below threshold, protocol violation, malformed message)."""


# a site's refusal of a new key setup (edge/secure.py)
ALREADY_RELEASED = "already released this contribution"


class AlreadyReleased(SecAggError):
    """A site refused the key setup of a sum whose contribution it already released, masked, under an earlier
    setup (the coordinator stopped between masking and unmask): that sum cannot be decoded any more; its
    budget is spent. A FedSGD round is then skipped; a one-shot release fails the job."""


class SetupIncomplete(SecAggError):
    """A site of the job took no part in the key setup (no advert, or not a share for every other site):
    nothing was masked, so nothing was charged; the round is redone under a new round id."""


@dataclass(frozen=True)
class RoundConfig:
    """Public parameters of one round, fixed by the signed job: the same at every site and the coordinator."""

    round_id: str  # binds signatures and masks to this round
    node_ids: tuple[int, ...]  # the job's sites
    threshold: int  # minimum number of sites in the sum; a strict majority (see the module's trust model)
    dim: int
    modulus_bits: int
    rounds: int = 1  # sums that share one key setup (one seed each); see SecAggSite

    def __post_init__(self) -> None:
        ids = tuple(sorted(self.node_ids))
        n = len(ids)
        if (
            n < 2
            or len(set(ids)) != n
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)
        ):
            raise SecAggError(
                f"secure aggregation: node ids must be >= 2 distinct integers >= 0, got {self.node_ids!r}"
            )
        if (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, int)
            or not (n // 2 < self.threshold <= n)
        ):
            raise SecAggError(
                f"secure aggregation: threshold must be a strict majority of the {n} sites "
                f"({n // 2 + 1}..{n}), got {self.threshold!r}"
            )
        if not (
            isinstance(self.dim, int)
            and self.dim >= 1
            and isinstance(self.modulus_bits, int)
            and 2 <= self.modulus_bits <= 64
            and self.round_id
            and isinstance(self.rounds, int)
            and not isinstance(self.rounds, bool)
            and 1 <= self.rounds <= 100_000
        ):
            raise SecAggError(
                f"secure aggregation: bad round parameters dim={self.dim!r} "
                f"modulus_bits={self.modulus_bits!r} round_id={self.round_id!r} rounds={self.rounds!r}"
            )
        object.__setattr__(self, "node_ids", ids)

    @property
    def mask(self) -> np.uint64:
        return np.uint64((1 << self.modulus_bits) - 1)


def key_advert(config: RoundConfig, node_id: int, pk1: bytes, pk2: bytes) -> bytes:
    """The bytes a site signs to vouch for its two public keys in this round."""
    return b"".join(
        [
            b"feta-secagg-keys\n",
            config.round_id.encode(),
            b"\n",
            node_id.to_bytes(8, "little"),
            len(pk1).to_bytes(4, "little"),
            pk1,
            pk2,
        ]
    )


def ed25519_signer(site_key: Ed25519PrivateKey) -> Signer:
    """The site's long-term Ed25519 key (``feta_release.signing.load_private_key``) as the key-advert
    signer."""
    return site_key.sign


def ed25519_verifier(site_keys: Mapping[int, Ed25519PublicKey]) -> Verifier:
    """Checks a key advert against the long-term public key of the site it names (from the signed job, e.g.
    ``feta_release.signing.load_public_key``); a site with no known key never verifies."""
    keys = dict(site_keys)

    def verify(node_id: int, message: bytes, signature: bytes) -> bool:
        key = keys.get(node_id)
        if key is None:
            return False
        try:
            key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    return verify


def prg_mask(key: bytes, config: RoundConfig, round_index: int = 0) -> np.ndarray:
    """``dim`` uniform residues mod 2^b from the ChaCha20 keystream under a 32-byte key (nonce bound to the
    round and the sum's index in it, so the masks of a long-lived pairwise key differ from sum to sum)."""
    nonce = hashlib.sha256(
        b"feta-secagg-mask\n" + config.round_id.encode() + b"\n" + str(round_index).encode()
    ).digest()[:16]
    stream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(8 * config.dim))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64) & config.mask


def _pair_key(private_pem: bytes, public_pem: bytes) -> bytes:
    # Flower's shared key is the urlsafe base64 (Fernet format) of HKDF-SHA256 over the ECDH secret: 32 raw
    # bytes.
    return base64.urlsafe_b64decode(
        generate_shared_key(bytes_to_private_key(private_pem), bytes_to_public_key(public_pem))
    )


def pairwise_mask(
    pair_key: bytes, adder: int, partner: int, config: RoundConfig, round_index: int = 0
) -> np.ndarray:
    """The pairwise mask site ``adder`` adds for ``partner`` under their shared key: +PRG if adder > partner,
    else -PRG, so the two sites' masks cancel in the sum."""
    m = prg_mask(pair_key, config, round_index)
    return m if adder > partner else (np.uint64(0) - m) & config.mask


def _check_residues(vector: np.ndarray, config: RoundConfig, where: str) -> np.ndarray:
    v = np.asarray(vector)
    if v.shape != (config.dim,) or v.dtype != np.uint64:
        raise SecAggError(
            f"{where}: expected {config.dim} uint64 residues, got shape {v.shape} dtype {v.dtype}"
        )
    if config.modulus_bits < 64 and (v > config.mask).any():
        raise SecAggError(
            f"{where}: {int((v > config.mask).sum())} value(s) outside the modulus 2^{config.modulus_bits}"
        )
    return v


# -- site side -----------------------------------------------------------------------------------------------


@dataclass
class SecAggSite:
    """One site's side. Call setup, share_keys, then masked_vector and unmask for each of the
    ``config.rounds`` sums (the shares arrive with the first masked_vector call).

    Several sums on one key setup (for FedSGD's many short rounds): one fresh mask seed per sum, each
    Shamir-shared up front; pairwise masks use the sum's index in the PRG nonce.  The setup goes on to the
    next sum only after a sum whose unmask request called EVERY site of the job alive; the first request that
    calls a site dropped (or leaves one out) is the setup's last sum at this site (:meth:`unmask`).  Going on
    with fewer peers would let a lying coordinator isolate this site in a later sum: split views in one sum
    rebuild the mask keys of some peers, the later sum would be masked against those peers only, and
    ``honest_shares`` (one sum, every site masking against every other) would no longer bound it.  Within a
    setup that goes on, no key share is ever revealed, so every sum of it is a one-sum case.
    """

    node_id: int
    config: RoundConfig
    sign: Signer  # signs this site's key advert with its long-term site key (see ed25519_signer)
    verify: Verifier  # checks the other sites' adverts against their long-term keys (see ed25519_verifier)
    stage: str = Stage.UNMASK  # the stage last completed (UNMASK: none started, as in Flower's mod)
    round_index: int = 0  # the next sum to mask
    sk1: bytes = b""
    pk1: bytes = b""
    sk2: bytes = b""
    pk2: bytes = b""
    rd_seeds: list[bytes] = field(default_factory=list)  # one per sum; wiped once its shares were revealed
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    neighbours: tuple[int, ...] = ()  # the sites whose shares this site holds (and that it masks against)
    dropped: tuple[int, ...] = ()  # peers whose mask key was revealed: never alive again in this setup
    revealed: tuple[int, ...] = ()  # peers a seed share was revealed for: never dropped in this setup
    seed_shares: dict[int, list[bytes]] = field(default_factory=dict)  # per peer, one share per sum
    sk1_shares: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.node_id not in self.config.node_ids:
            raise SecAggError(
                f"secure aggregation: node {self.node_id} is not a site of round {self.config.round_id}"
            )

    @property
    def _where(self) -> str:
        return f"node {self.node_id}, round {self.config.round_id}"

    def to_record(self) -> dict[str, int | str | bytes | list[int] | list[bytes]]:
        """The site's state as flat ConfigRecord values (each Flower message runs in a fresh ClientApp
        process; the node keeps this record in its private state between requests). Holds secrets: never
        leaves the site."""
        ids = sorted(self.public_keys)
        share_ids = sorted(self.seed_shares)
        return {
            "stage": self.stage,
            "round_index": self.round_index,
            "sk1": self.sk1,
            "pk1": self.pk1,
            "sk2": self.sk2,
            "pk2": self.pk2,
            "rd_seeds": list(self.rd_seeds),
            "peer_ids": ids,
            "peer_pk1": [self.public_keys[i][0] for i in ids],
            "peer_pk2": [self.public_keys[i][1] for i in ids],
            "neighbours": list(self.neighbours),
            "dropped": list(self.dropped),
            "revealed": list(self.revealed),
            "share_ids": share_ids,
            "seed_shares": [sh for i in share_ids for sh in self.seed_shares[i]],
            "sk1_shares": [self.sk1_shares[i] for i in share_ids],
        }

    @classmethod
    def from_record(
        cls, node_id: int, config: RoundConfig, rec: Mapping[str, object], sign: Signer, verify: Verifier
    ) -> SecAggSite:
        def get(key: str) -> Any:
            if key not in rec:
                raise SecAggError(
                    f"node {node_id}: the stored secure-aggregation state lacks {key!r}; restart the round"
                )
            return rec[key]

        peers, share_ids, flat = list(get("peer_ids")), list(get("share_ids")), list(get("seed_shares"))
        n = config.rounds
        if len(flat) != n * len(share_ids):
            raise SecAggError(
                f"node {node_id}: the stored secure-aggregation state holds {len(flat)} seed shares for "
                f"{len(share_ids)} sites and {n} sums; restart the round"
            )
        return cls(
            node_id,
            config,
            sign,
            verify,
            stage=str(get("stage")),
            round_index=int(get("round_index")),
            sk1=get("sk1"),
            pk1=get("pk1"),
            sk2=get("sk2"),
            pk2=get("pk2"),
            rd_seeds=list(get("rd_seeds")),
            public_keys=dict(zip(peers, zip(get("peer_pk1"), get("peer_pk2"), strict=True), strict=True)),
            neighbours=tuple(get("neighbours")),
            dropped=tuple(get("dropped")),
            revealed=tuple(get("revealed")),
            seed_shares={nid: flat[k * n : (k + 1) * n] for k, nid in enumerate(share_ids)},
            sk1_shares=dict(zip(share_ids, get("sk1_shares"), strict=True)),
        )

    def _enter(self, stage: str) -> None:
        expected = STAGES[(STAGES.index(self.stage) + 1) % len(STAGES)]
        in_session = self.stage == Stage.UNMASK and 0 < self.round_index < self.config.rounds
        # A new setup may start at any point (as in Flower's mod): it is how a refused sum is redone, and it
        # wipes every secret of the old one (whose masked vector can then never be unmasked).
        if (
            stage == Stage.COLLECT_MASKED_VECTORS
            and self.stage == Stage.UNMASK
            and self.round_index >= self.config.rounds
        ):
            raise SecAggError(
                f"node {self.node_id}: key setup {self.config.round_id} is over (its sums are done, or its "
                f"last unmask request did not call every site alive); refused: start a new key setup"
            )
        if (
            stage != expected
            and stage != Stage.SETUP
            and not (stage == Stage.COLLECT_MASKED_VECTORS and in_session)
        ):
            raise SecAggError(
                f"node {self.node_id}: secure aggregation expects stage {expected!r}, got {stage!r}; "
                f"round {self.config.round_id} refused"
            )
        if stage == Stage.SETUP:  # a new key setup forgets the old one entirely
            self.round_index, self.dropped, self.revealed, self.neighbours = 0, (), (), ()
            self.seed_shares, self.sk1_shares, self.rd_seeds = {}, {}, []
        self.stage = stage

    def setup(self) -> KeyAdvert:
        """Fresh ECDH key pairs (pk1 for masks, pk2 for encrypting shares) and their signature."""
        self._enter(Stage.SETUP)
        sk1, pk1 = generate_key_pairs()
        sk2, pk2 = generate_key_pairs()
        self.sk1, self.pk1 = private_key_to_bytes(sk1), public_key_to_bytes(pk1)
        self.sk2, self.pk2 = private_key_to_bytes(sk2), public_key_to_bytes(pk2)
        return self.pk1, self.pk2, self.sign(key_advert(self.config, self.node_id, self.pk1, self.pk2))

    def share_keys(self, keys: Mapping[int, KeyAdvert]) -> dict[int, bytes]:
        """Check the broadcast keys, Shamir-share the mask seeds and sk1, return one ciphertext per other
        site."""
        self._enter(Stage.SHARE_KEYS)
        self._check_keys(keys)
        self.public_keys = {nid: (k[0], k[1]) for nid, k in keys.items()}
        self.rd_seeds = [os.urandom(32) for _ in range(self.config.rounds)]
        ids = sorted(self.public_keys)
        per_sum = [create_shares(seed, self.config.threshold, len(ids)) for seed in self.rd_seeds]
        sk1_shares = create_shares(self.sk1, self.config.threshold, len(ids))
        out: dict[int, bytes] = {}
        for idx, nid in enumerate(ids):
            if nid == self.node_id:
                self.seed_shares[nid] = [shares[idx] for shares in per_sum]
                self.sk1_shares[nid] = sk1_shares[idx]
                continue
            # Flower's plaintext layout; the seed-share field carries one equal-length share per sum
            seed_field = b"".join(shares[idx] for shares in per_sum)
            plaintext = share_keys_plaintext_concat(self.node_id, nid, seed_field, sk1_shares[idx])
            out[nid] = encrypt(
                generate_shared_key(bytes_to_private_key(self.sk2), bytes_to_public_key(keys[nid][1])),
                plaintext,
            )
        return out

    def _check_keys(self, keys: Mapping[int, KeyAdvert]) -> None:
        where = f"node {self.node_id}, round {self.config.round_id}"
        if not set(keys) <= set(self.config.node_ids):
            raise SecAggError(
                f"{where}: keys of sites outside the job: {sorted(set(keys) - set(self.config.node_ids))}"
            )
        # Every site of the job takes part in the key setup: a site that masks against fewer peers than all
        # can be isolated by a coordinator that chooses whose shares it receives (see the module's trust
        # model).
        if set(keys) != set(self.config.node_ids):
            raise SecAggError(
                f"{where}: keys of sites {sorted(set(self.config.node_ids) - set(keys))} are missing; "
                f"every site of the job must take part in the key setup; refused: redo the round"
            )
        if keys.get(self.node_id, (b"", b""))[:2] != (self.pk1, self.pk2):
            raise SecAggError(
                f"{where}: the coordinator did not return this site's own public keys unchanged"
            )
        flat = [pk for k in keys.values() for pk in k[:2]]
        if len(set(flat)) != len(flat):
            raise SecAggError(f"{where}: two sites advertise the same public key; refused")
        # Unsigned keys would let an active coordinator substitute its own and read every share: always
        # checked.
        for nid, advert in keys.items():
            if (
                len(advert) != 3
                or not isinstance(advert[2], bytes)
                or not advert[2]
                or not self.verify(nid, key_advert(self.config, nid, advert[0], advert[1]), advert[2])
            ):
                raise SecAggError(
                    f"{where}: the public keys of site {nid} are not signed by its site key; refused"
                )

    def _receive_shares(self, ciphertexts: Mapping[int, bytes]) -> None:
        expected = set(self.public_keys) - {self.node_id}
        if set(ciphertexts) != expected:
            # masking against only the peers whose shares arrived lets the coordinator pick them: refused
            raise SecAggError(
                f"{self._where}: shares from {sorted(ciphertexts)}, but every other site of the key "
                f"setup ({sorted(expected)}) must send one; refused: redo the round"
            )
        for src, ct in ciphertexts.items():
            if src == self.node_id or src not in self.public_keys:
                raise SecAggError(
                    f"{self._where}: a share from site {src}, which is not a peer of this round"
                )
            key = generate_shared_key(
                bytes_to_private_key(self.sk2), bytes_to_public_key(self.public_keys[src][1])
            )
            try:
                actual_src, dst, seed_field, sk1_share = share_keys_plaintext_separate(decrypt(key, ct))
            except InvalidToken:
                raise SecAggError(
                    f"{self._where}: the share from site {src} does not decrypt (tampered or misrouted)"
                ) from None
            if actual_src != src or dst != self.node_id:
                raise SecAggError(
                    f"{self._where}: a share labelled {actual_src}->{dst} arrived as {src}->{self.node_id}"
                )
            n = self.config.rounds
            if not seed_field or len(seed_field) % n:
                raise SecAggError(f"{self._where}: the share from site {src} does not hold {n} seed shares")
            step = len(seed_field) // n
            self.seed_shares[src] = [seed_field[i * step : (i + 1) * step] for i in range(n)]
            self.sk1_shares[src] = sk1_share
        self.neighbours = tuple(sorted(ciphertexts))

    def masked_vector(self, ciphertexts: Mapping[int, bytes] | None, contribution: np.ndarray) -> np.ndarray:
        """Return this site's contribution (residues mod m, e.g. from
        :func:`feta_release.mechanisms.skellam.site_contribution`) masked by this sum's seed and the pairwise
        masks. The first sum of a setup brings the shares addressed to this site (``ciphertexts``); later sums
        bring none."""
        self._enter(Stage.COLLECT_MASKED_VECTORS)
        vector = _check_residues(contribution, self.config, f"{self._where}: contribution")
        if self.round_index == 0:
            if ciphertexts is None:
                raise SecAggError(f"{self._where}: the first sum needs the shares of the other sites")
            self._receive_shares(ciphertexts)
        elif ciphertexts:
            raise SecAggError(
                f"{self._where}: shares arrive once per key setup, not at sum {self.round_index}"
            )
        peers = [nid for nid in self.neighbours if nid not in self.dropped]
        if len(peers) + 1 < self.config.threshold:
            raise SecAggError(
                f"{self._where}: {len(peers)} other site(s) left, below the threshold "
                f"{self.config.threshold}; refused"
            )
        r = self.round_index
        masked = vector + prg_mask(self.rd_seeds[r], self.config, r)
        for nid in peers:
            key = _pair_key(self.sk1, self.public_keys[nid][0])
            masked = masked + pairwise_mask(key, self.node_id, nid, self.config, r)
        return masked & self.config.mask

    def unmask(self, active: list[int], dead: list[int]) -> dict[int, bytes]:
        """For each alive site the share of this sum's seed, for each dropped one the share of its sk1; never
        both, and never both across the sums of one key setup: no seed share of a site whose key was revealed
        before, and no key share of a site whose seed share for an earlier sum was revealed (its key rebuilds
        its pairwise masks of every sum, the seed the rest: its earlier vector would be unmasked alone).  Such
        a sum must be redone on a new key setup.  A request that does not call every site of the job alive is
        the last sum of this key setup at this site: the next sum needs a new setup (see the class doc)."""
        self._enter(Stage.UNMASK)
        r = self.round_index
        self.round_index += 1  # this sum is over whatever happens below: a refused request cannot be retried
        peers = {nid for nid in self.neighbours if nid not in self.dropped}
        if set(active) & set(dead):
            raise SecAggError(
                f"{self._where}: sites {sorted(set(active) & set(dead))} are called both alive and "
                f"dropped; revealing both shares would unmask them; refused"
            )
        if set(active) & set(self.dropped):
            raise SecAggError(
                f"{self._where}: sites {sorted(set(active) & set(self.dropped))} dropped out of an "
                f"earlier sum (their key is known) and cannot be alive again; refused"
            )
        if set(dead) & set(self.revealed):
            raise SecAggError(
                f"{self._where}: sites {sorted(set(dead) & set(self.revealed))} were alive in an earlier "
                f"sum (their seed share is out); revealing their key would unmask that sum's vector; "
                f"refused: redo the sum on a new key setup"
            )
        if not (set(active) | set(dead)) <= peers | {self.node_id} or self.node_id not in active:
            raise SecAggError(
                f"{self._where}: the unmask request names sites outside this site's peers or omits this site"
            )
        if len(set(active)) < self.config.threshold:
            raise SecAggError(
                f"{self._where}: {len(set(active))} alive sites, below the threshold "
                f"{self.config.threshold}; refused"
            )
        out = {nid: self.seed_shares[nid][r] for nid in sorted(set(active))}
        out.update({nid: self.sk1_shares[nid] for nid in sorted(set(dead))})
        self.dropped = tuple(sorted(set(self.dropped) | set(dead)))
        self.revealed = tuple(sorted(set(self.revealed) | (set(active) - {self.node_id})))
        # the secrets of this sum are of no further use: keep no copy a later request could draw on
        self.rd_seeds[r] = b""
        for shares in self.seed_shares.values():
            shares[r] = b""
        # a dropout in this site's view ends the key setup (class doc)
        if set(active) != set(self.config.node_ids):
            self.round_index = self.config.rounds
        if self.round_index >= self.config.rounds:
            self.seed_shares, self.sk1_shares, self.rd_seeds = {}, {}, []
        return out


# -- coordinator side ----------------------------------------------------------------------------------------


@dataclass
class SecAggCoordinator:
    """The coordinator's side: routes keys and encrypted shares, sums the masked vectors, removes the masks.

    ``refused`` records the sites excluded from the sum and why (e.g. a vector outside the modulus);
    ``contributors`` after :meth:`finish` is the set of sites whose vectors (data and noise share) are in the
    sum. With ``config.rounds`` > 1, collect_masked and finish repeat once per sum while every site of the job
    is in each; a sum with a site missing is the setup's last (the sites end it there too:
    see :class:`SecAggSite`), and the next sum needs a new key setup.
    """

    config: RoundConfig
    keys: dict[int, KeyAdvert] = field(default_factory=dict)
    sharers: tuple[int, ...] = ()  # U1: sites that distributed their shares
    neighbours: dict[int, tuple[int, ...]] = field(default_factory=dict)
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    contributors: tuple[int, ...] = ()
    round_index: int = 0
    dropped: tuple[int, ...] = ()
    # sites in an earlier sum of this setup: the sites refuse to call them dropped
    was_alive: tuple[int, ...] = ()

    def _require(self, alive: set[int] | tuple[int, ...], stage: str) -> None:
        if len(alive) < self.config.threshold:
            raise SecAggError(
                f"round {self.config.round_id}: {len(alive)} site(s) left at stage {stage!r}, below the "
                f"threshold {self.config.threshold}; the round is refused (nothing is decoded)"
            )

    def collect_keys(self, replies: Mapping[int, KeyAdvert]) -> dict[int, KeyAdvert]:
        """Setup replies -> the key broadcast for the share_keys stage."""
        self.keys = {}
        for nid, r in replies.items():
            if nid not in self.config.node_ids:
                continue
            # the sites would refuse the whole broadcast
            if len(r) != 3 or not isinstance(r[2], bytes) or not r[2]:
                self.refused[nid] = "its key advert is not signed"
                continue
            self.keys[nid] = (r[0], r[1], r[2])
        missing = sorted(set(self.config.node_ids) - set(self.keys))
        if missing:  # the sites refuse a key setup without every site of the job (see SecAggSite._check_keys)
            raise SetupIncomplete(
                f"round {self.config.round_id}: no signed key advert from site(s) {missing}; "
                f"every site of the job must take part; nothing was masked: redo the round"
            )
        return dict(self.keys)

    def route_shares(self, replies: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """share_keys replies (per sender: recipient -> ciphertext) -> per recipient: sender -> ciphertext."""
        members = set(self.keys)
        complete = {src for src, cts in replies.items() if src in members and set(cts) == members - {src}}
        for src in set(replies) - complete:
            self.refused[src] = "its share_keys reply does not address every other site"
        self.sharers = tuple(sorted(complete))
        if complete != members:  # each site masks against every other one, so each needs every share
            raise SetupIncomplete(
                f"round {self.config.round_id}: site(s) {sorted(members - complete)} did not share "
                f"their keys with every other site; nothing was masked: redo the round"
            )
        routed = {dst: {src: replies[src][dst] for src in self.sharers if src != dst} for dst in self.sharers}
        self.neighbours = {dst: tuple(sorted(cts)) for dst, cts in routed.items()}
        return routed

    def collect_masked(self, vectors: Mapping[int, np.ndarray]) -> dict[int, tuple[list[int], list[int]]]:
        """Masked vectors -> the unmask request (alive, dropped) for each site in the sum. A vector that is
        not ``dim`` residues mod m is refused and its site treated as dropped."""
        if self.round_index >= self.config.rounds:
            raise SecAggError(
                f"round {self.config.round_id}: this key setup is over (its {self.config.rounds} sum(s) "
                f"are done, or its last sum had a site missing); start a new key setup"
            )
        self.masked = {}
        for nid, vec in vectors.items():
            if nid not in self.sharers or nid in self.dropped:
                self.refused[nid] = (
                    "sent a masked vector without having shared its keys, or after dropping out"
                )
                continue
            try:
                self.masked[nid] = _check_residues(vec, self.config, f"masked vector of site {nid}")
            except SecAggError as exc:
                self.refused[nid] = str(exc)
        self._require(set(self.masked), Stage.COLLECT_MASKED_VECTORS)
        alive = sorted(self.masked)
        dead = sorted(set(self.sharers) - set(self.dropped) - set(alive))
        if set(dead) & set(self.was_alive):
            raise SecAggError(
                f"round {self.config.round_id}: sites {sorted(set(dead) & set(self.was_alive))} were in an "
                f"earlier sum of this key setup and are missing now; the sites refuse to reveal their keys "
                f"(it would unmask their earlier vectors); redo the sum on a new key setup"
            )
        return {
            nid: (
                [a for a in alive if a == nid or a in self.neighbours[nid]],
                [d for d in dead if d in self.neighbours[nid]],
            )
            for nid in alive
        }

    def finish(self, replies: Mapping[int, Mapping[int, bytes]]) -> np.ndarray:
        """Unmask replies -> the sum mod m of the alive sites' contributions (uint64 residues)."""
        answered = {nid: r for nid, r in replies.items() if nid in self.masked}
        self._require(set(answered), Stage.UNMASK)
        total = np.zeros(self.config.dim, dtype=np.uint64)
        for vec in self.masked.values():
            total = total + vec
        alive = sorted(self.masked)
        r = self.round_index
        newly_dead = sorted(set(self.sharers) - set(self.dropped) - set(alive))
        for nid in alive + newly_dead:
            secret = self._reconstruct(nid, [rep[nid] for rep in answered.values() if nid in rep])
            if nid in self.masked:  # its own seed mask for this sum
                total = total - prg_mask(secret, self.config, r)
                continue
            for other in alive:  # a dropped site: remove the pairwise masks the alive sites added for it
                if nid in self.neighbours[other]:
                    total = total - pairwise_mask(
                        _pair_key(secret, self.keys[other][0]), other, nid, self.config, r
                    )
        self.contributors = tuple(alive)
        self.was_alive = tuple(sorted(set(self.was_alive) | set(alive)))
        self.dropped = tuple(sorted(set(self.dropped) | set(newly_dead)))
        self.round_index += 1
        # the sites end the setup at a dropout: so does the coordinator
        if set(alive) != set(self.config.node_ids):
            self.round_index = self.config.rounds
        self.masked = {}
        return total & self.config.mask

    def _reconstruct(self, nid: int, shares: list[bytes]) -> bytes:
        if len(shares) < self.config.threshold:
            raise SecAggError(
                f"round {self.config.round_id}: {len(shares)} share(s) of site {nid}'s secret, below the "
                f"threshold {self.config.threshold}; the round is refused (nothing is decoded)"
            )
        try:
            return combine_shares(shares[: self.config.threshold])
        except ValueError:
            raise SecAggError(
                f"round {self.config.round_id}: the shares of site {nid}'s secret do not combine "
                f"(a corrupted share); the round is refused"
            ) from None
