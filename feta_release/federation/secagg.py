"""Secure summation of the sites' Skellam contributions (SecAgg / SecAgg+ of Bonawitz et al. 2017 and Bell et al.
2020, the protocol Flower's ``secaggplus_mod`` / ``SecAggPlusWorkflow`` implement), as message-level logic: one
:class:`SecAggSite` per site, one :class:`SecAggCoordinator`, four stages (Flower's ``Stage``: setup, share_keys,
collect_masked_vectors, unmask).  The coordinator learns only the sum mod m of the vectors of the sites that
reached the masking stage; no single vector.

Flower's primitives are used as they are: ECDH key pairs (``flwr.supercore.primitives.asymmetric``, SECP384R1),
the HKDF-derived shared keys and Fernet encryption of the shares (``secure_aggregation.crypto.
symmetric_encryption``), Shamir secret sharing (``secure_aggregation.crypto.shamir``, pycryptodome) and the share
plaintext layout (``secaggplus_utils``).  Flower's protocol STAGES are re-wired here, because:
  * Flower's SecAgg+ runs only through the legacy compat layer (DefaultWorkflow + NumPyClient + secaggplus_mod,
    on train messages), while the node answers signed job requests on its own message types and must run its
    trust checks (signed job, policy, ledger) before any byte leaves the site;
  * its quantization (clip + stochastic rounding, no noise) is not the Skellam mechanism: the vector masked here
    is the site's Skellam contribution (per-record conditional rounding + its noise share), already mod m;
  * its mask expansion ``pseudo_rand_gen`` folds the 256-bit seed to a 32-bit seed of numpy's Mersenne Twister
    (2^32 seeds can be searched, and MT19937's output is predictable) and draws ``randint(0, m - 1)``, which never
    yields m - 1 (masked values are not uniform).  Masks here are the ChaCha20 keystream (``cryptography``) under
    the 256-bit seed / shared key, read as uint64 and reduced mod m = 2^b: exactly uniform, cryptographic.

Trust model: honest-but-curious coordinator; a site's key advertisement may be signed with its long-term key
(``sign`` / ``verify``) so that an active coordinator cannot substitute keys.  Each site reveals, per other site,
EITHER the share of its mask seed (the site is alive) OR of its mask key (it dropped out), never both, and the
threshold is a strict majority, so no two answers can unmask one vector.  Below the threshold the round is refused.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import Stage
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat, share_keys_plaintext_separate
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
KeyAdvert = tuple[bytes, bytes, bytes | None]  # (pk1, pk2, signature of key_advert or None)


class SecAggError(PrivacyError):
    """A secure-aggregation round is refused (below threshold, protocol violation, malformed message)."""


@dataclass(frozen=True)
class RoundConfig:
    """Public parameters of one round, fixed by the signed job: the same at every site and the coordinator."""

    round_id: str  # binds signatures and masks to this round
    node_ids: tuple[int, ...]  # the job's sites
    threshold: int  # minimum number of sites in the sum; a strict majority
    dim: int
    modulus_bits: int

    def __post_init__(self) -> None:
        ids = tuple(sorted(self.node_ids))
        n = len(ids)
        if n < 2 or len(set(ids)) != n or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise SecAggError(f"secure aggregation: node ids must be >= 2 distinct integers >= 0, got {self.node_ids!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or not (n // 2 < self.threshold <= n):
            raise SecAggError(f"secure aggregation: threshold must be a strict majority of the {n} sites "
                              f"({n // 2 + 1}..{n}), got {self.threshold!r}")
        if not (isinstance(self.dim, int) and self.dim >= 1 and isinstance(self.modulus_bits, int)
                and 2 <= self.modulus_bits <= 64 and self.round_id):
            raise SecAggError(f"secure aggregation: bad round parameters dim={self.dim!r} "
                              f"modulus_bits={self.modulus_bits!r} round_id={self.round_id!r}")
        object.__setattr__(self, "node_ids", ids)

    @property
    def mask(self) -> np.uint64:
        return np.uint64((1 << self.modulus_bits) - 1)


def key_advert(config: RoundConfig, node_id: int, pk1: bytes, pk2: bytes) -> bytes:
    """The bytes a site signs to vouch for its two public keys in this round."""
    return b"".join([b"feta-secagg-keys\n", config.round_id.encode(), b"\n", node_id.to_bytes(8, "little"),
                     len(pk1).to_bytes(4, "little"), pk1, pk2])


def prg_mask(key: bytes, config: RoundConfig) -> np.ndarray:
    """``dim`` uniform residues mod 2^b from the ChaCha20 keystream under a 32-byte key (nonce bound to the round)."""
    nonce = hashlib.sha256(b"feta-secagg-mask\n" + config.round_id.encode()).digest()[:16]
    stream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(8 * config.dim))
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64) & config.mask


def _pair_key(private_pem: bytes, public_pem: bytes) -> bytes:
    # Flower's shared key is the urlsafe base64 (Fernet format) of HKDF-SHA256 over the ECDH secret: 32 raw bytes.
    return base64.urlsafe_b64decode(generate_shared_key(bytes_to_private_key(private_pem), bytes_to_public_key(public_pem)))


def pairwise_mask(pair_key: bytes, adder: int, partner: int, config: RoundConfig) -> np.ndarray:
    """The pairwise mask site ``adder`` adds for ``partner`` under their shared key: +PRG if adder > partner, else
    -PRG, so the two sites' masks cancel in the sum."""
    m = prg_mask(pair_key, config)
    return m if adder > partner else (np.uint64(0) - m) & config.mask


def _check_residues(vector: np.ndarray, config: RoundConfig, where: str) -> np.ndarray:
    v = np.asarray(vector)
    if v.shape != (config.dim,) or v.dtype != np.uint64:
        raise SecAggError(f"{where}: expected {config.dim} uint64 residues, got shape {v.shape} dtype {v.dtype}")
    if config.modulus_bits < 64 and (v > config.mask).any():
        raise SecAggError(f"{where}: {int((v > config.mask).sum())} value(s) outside the modulus 2^{config.modulus_bits}")
    return v


# -- site side -----------------------------------------------------------------------------------------------


@dataclass
class SecAggSite:
    """One site's side of a round. Call setup, share_keys, masked_vector, unmask in that order (each once)."""

    node_id: int
    config: RoundConfig
    sign: Signer | None = None
    verify: Verifier | None = None
    stage: str = Stage.UNMASK  # the stage last completed (UNMASK: none started, as in Flower's mod)
    sk1: bytes = b""
    pk1: bytes = b""
    sk2: bytes = b""
    pk2: bytes = b""
    rd_seed: bytes = b""
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    neighbours: tuple[int, ...] = ()  # the sites whose shares this site holds (and that it masked against)
    seed_shares: dict[int, bytes] = field(default_factory=dict)
    sk1_shares: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.node_id not in self.config.node_ids:
            raise SecAggError(f"secure aggregation: node {self.node_id} is not a site of round {self.config.round_id}")

    def to_record(self) -> dict[str, int | str | bytes | list[int] | list[bytes]]:
        """The site's round state as flat ConfigRecord values (each Flower message runs in a fresh ClientApp
        process; the node keeps this record in its private state between the four stages). Holds secrets."""
        ids = sorted(self.public_keys)
        return {"stage": self.stage, "sk1": self.sk1, "pk1": self.pk1, "sk2": self.sk2, "pk2": self.pk2,
                "rd_seed": self.rd_seed, "peer_ids": ids, "peer_pk1": [self.public_keys[i][0] for i in ids],
                "peer_pk2": [self.public_keys[i][1] for i in ids], "neighbours": list(self.neighbours),
                "share_ids": sorted(self.seed_shares), "seed_shares": [self.seed_shares[i] for i in sorted(self.seed_shares)],
                "sk1_shares": [self.sk1_shares[i] for i in sorted(self.seed_shares)]}

    @classmethod
    def from_record(cls, node_id: int, config: RoundConfig, rec: Mapping[str, object], sign: Signer | None = None,
                    verify: Verifier | None = None) -> SecAggSite:
        def get(key: str) -> object:
            if key not in rec:
                raise SecAggError(f"node {node_id}: the stored secure-aggregation state lacks {key!r}; restart the round")
            return rec[key]

        peers, share_ids = list(get("peer_ids")), list(get("share_ids"))  # type: ignore[call-overload]
        return cls(node_id, config, sign, verify, stage=str(get("stage")), sk1=get("sk1"), pk1=get("pk1"),  # type: ignore[arg-type]
                   sk2=get("sk2"), pk2=get("pk2"), rd_seed=get("rd_seed"),  # type: ignore[arg-type]
                   public_keys=dict(zip(peers, zip(get("peer_pk1"), get("peer_pk2"), strict=True), strict=True)),  # type: ignore[call-overload]
                   neighbours=tuple(get("neighbours")),  # type: ignore[arg-type]
                   seed_shares=dict(zip(share_ids, get("seed_shares"), strict=True)),  # type: ignore[call-overload]
                   sk1_shares=dict(zip(share_ids, get("sk1_shares"), strict=True)))  # type: ignore[call-overload]

    def _enter(self, stage: str) -> None:
        expected = STAGES[(STAGES.index(self.stage) + 1) % len(STAGES)]
        if stage != expected:
            raise SecAggError(f"node {self.node_id}: secure aggregation expects stage {expected!r}, got {stage!r}; "
                              f"round {self.config.round_id} refused")
        self.stage = stage

    def setup(self) -> KeyAdvert:
        """Fresh ECDH key pairs (pk1 for masks, pk2 for encrypting shares) and their signature."""
        self._enter(Stage.SETUP)
        sk1, pk1 = generate_key_pairs()
        sk2, pk2 = generate_key_pairs()
        self.sk1, self.pk1 = private_key_to_bytes(sk1), public_key_to_bytes(pk1)
        self.sk2, self.pk2 = private_key_to_bytes(sk2), public_key_to_bytes(pk2)
        sig = self.sign(key_advert(self.config, self.node_id, self.pk1, self.pk2)) if self.sign else None
        return self.pk1, self.pk2, sig

    def share_keys(self, keys: Mapping[int, KeyAdvert]) -> dict[int, bytes]:
        """Check the broadcast keys, Shamir-share the mask seed and sk1, return one ciphertext per other site."""
        self._enter(Stage.SHARE_KEYS)
        self._check_keys(keys)
        self.public_keys = {nid: (k[0], k[1]) for nid, k in keys.items()}
        self.rd_seed = os.urandom(32)
        ids = sorted(self.public_keys)
        seed_shares = create_shares(self.rd_seed, self.config.threshold, len(ids))
        sk1_shares = create_shares(self.sk1, self.config.threshold, len(ids))
        out: dict[int, bytes] = {}
        for idx, nid in enumerate(ids):
            if nid == self.node_id:
                self.seed_shares[nid], self.sk1_shares[nid] = seed_shares[idx], sk1_shares[idx]
                continue
            plaintext = share_keys_plaintext_concat(self.node_id, nid, seed_shares[idx], sk1_shares[idx])
            out[nid] = encrypt(generate_shared_key(bytes_to_private_key(self.sk2), bytes_to_public_key(keys[nid][1])),
                               plaintext)
        return out

    def _check_keys(self, keys: Mapping[int, KeyAdvert]) -> None:
        where = f"node {self.node_id}, round {self.config.round_id}"
        if not set(keys) <= set(self.config.node_ids):
            raise SecAggError(f"{where}: keys of sites outside the job: {sorted(set(keys) - set(self.config.node_ids))}")
        if len(keys) < self.config.threshold:
            raise SecAggError(f"{where}: {len(keys)} sites left, below the threshold {self.config.threshold}; refused")
        if keys.get(self.node_id, (b"", b""))[:2] != (self.pk1, self.pk2):
            raise SecAggError(f"{where}: the coordinator did not return this site's own public keys unchanged")
        flat = [pk for k in keys.values() for pk in k[:2]]
        if len(set(flat)) != len(flat):
            raise SecAggError(f"{where}: two sites advertise the same public key; refused")
        if self.verify is not None:
            for nid, (pk1, pk2, sig) in keys.items():
                if sig is None or not self.verify(nid, key_advert(self.config, nid, pk1, pk2), sig):
                    raise SecAggError(f"{where}: the public keys of site {nid} are not signed by its site key; refused")

    def masked_vector(self, ciphertexts: Mapping[int, bytes], contribution: np.ndarray) -> np.ndarray:
        """Store the shares addressed to this site and return its contribution (residues mod m, e.g. from
        :func:`feta_release.mechanisms.skellam.site_contribution`) masked by its seed and the pairwise masks."""
        self._enter(Stage.COLLECT_MASKED_VECTORS)
        where = f"node {self.node_id}, round {self.config.round_id}"
        vector = _check_residues(contribution, self.config, f"{where}: contribution")
        if len(ciphertexts) + 1 < self.config.threshold:
            raise SecAggError(f"{where}: shares of {len(ciphertexts)} other site(s), below the threshold "
                              f"{self.config.threshold}; refused")
        for src, ct in ciphertexts.items():
            if src == self.node_id or src not in self.public_keys:
                raise SecAggError(f"{where}: a share from site {src}, which is not a peer of this round")
            key = generate_shared_key(bytes_to_private_key(self.sk2), bytes_to_public_key(self.public_keys[src][1]))
            try:
                actual_src, dst, seed_share, sk1_share = share_keys_plaintext_separate(decrypt(key, ct))
            except InvalidToken:
                raise SecAggError(f"{where}: the share from site {src} does not decrypt (tampered or misrouted)") from None
            if actual_src != src or dst != self.node_id:
                raise SecAggError(f"{where}: a share labelled {actual_src}->{dst} arrived as {src}->{self.node_id}")
            self.seed_shares[src], self.sk1_shares[src] = seed_share, sk1_share
        self.neighbours = tuple(sorted(ciphertexts))
        masked = vector + prg_mask(self.rd_seed, self.config)
        for nid in self.neighbours:
            masked = masked + pairwise_mask(_pair_key(self.sk1, self.public_keys[nid][0]), self.node_id, nid, self.config)
        return masked & self.config.mask

    def unmask(self, active: list[int], dead: list[int]) -> dict[int, bytes]:
        """For each alive site the share of its mask seed, for each dropped one the share of its sk1; never both."""
        self._enter(Stage.UNMASK)
        where = f"node {self.node_id}, round {self.config.round_id}"
        known = set(self.neighbours) | {self.node_id}
        if set(active) & set(dead):
            raise SecAggError(f"{where}: sites {sorted(set(active) & set(dead))} are called both alive and dropped; "
                              f"revealing both shares would unmask them; refused")
        if not (set(active) | set(dead)) <= known or self.node_id not in active:
            raise SecAggError(f"{where}: the unmask request names sites outside this site's peers or omits this site")
        if len(set(active)) < self.config.threshold:
            raise SecAggError(f"{where}: {len(set(active))} alive sites, below the threshold {self.config.threshold}; "
                              f"refused")
        out = {nid: self.seed_shares[nid] for nid in sorted(set(active))}
        out.update({nid: self.sk1_shares[nid] for nid in sorted(set(dead))})
        # the secrets of this round are of no further use: keep no copy a later request could draw on
        self.seed_shares, self.sk1_shares, self.rd_seed = {}, {}, b""
        return out


# -- coordinator side ----------------------------------------------------------------------------------------


@dataclass
class SecAggCoordinator:
    """The coordinator's side: routes keys and encrypted shares, sums the masked vectors, removes the masks.

    ``refused`` records the sites excluded from the sum and why (e.g. a vector outside the modulus);
    ``contributors`` after :meth:`finish` is the set of sites whose vectors (data and noise share) are in the sum.
    """

    config: RoundConfig
    keys: dict[int, KeyAdvert] = field(default_factory=dict)
    sharers: tuple[int, ...] = ()  # U1: sites that distributed their shares
    neighbours: dict[int, tuple[int, ...]] = field(default_factory=dict)
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    contributors: tuple[int, ...] = ()

    def _require(self, alive: set[int] | tuple[int, ...], stage: str) -> None:
        if len(alive) < self.config.threshold:
            raise SecAggError(f"round {self.config.round_id}: {len(alive)} site(s) left at stage {stage!r}, below the "
                              f"threshold {self.config.threshold}; the round is refused (nothing is decoded)")

    def collect_keys(self, replies: Mapping[int, KeyAdvert]) -> dict[int, KeyAdvert]:
        """Setup replies -> the key broadcast for the share_keys stage."""
        self.keys = {nid: tuple(r) for nid, r in replies.items() if nid in self.config.node_ids}  # type: ignore[misc]
        self._require(set(self.keys), Stage.SETUP)
        return dict(self.keys)

    def route_shares(self, replies: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """share_keys replies (per sender: recipient -> ciphertext) -> per recipient: sender -> ciphertext."""
        members = set(self.keys)
        complete = {src for src, cts in replies.items() if src in members and set(cts) == members - {src}}
        for src in set(replies) - complete:
            self.refused[src] = "its share_keys reply does not address every other site"
        self.sharers = tuple(sorted(complete))
        self._require(complete, Stage.SHARE_KEYS)
        routed = {dst: {src: replies[src][dst] for src in self.sharers if src != dst} for dst in self.sharers}
        self.neighbours = {dst: tuple(sorted(cts)) for dst, cts in routed.items()}
        return routed

    def collect_masked(self, vectors: Mapping[int, np.ndarray]) -> dict[int, tuple[list[int], list[int]]]:
        """Masked vectors -> the unmask request (alive, dropped) for each site in the sum. A vector that is not
        ``dim`` residues mod m is refused and its site treated as dropped."""
        for nid, vec in vectors.items():
            if nid not in self.sharers:
                self.refused[nid] = "sent a masked vector without having shared its keys"
                continue
            try:
                self.masked[nid] = _check_residues(vec, self.config, f"masked vector of site {nid}")
            except SecAggError as exc:
                self.refused[nid] = str(exc)
        self._require(set(self.masked), Stage.COLLECT_MASKED_VECTORS)
        alive = sorted(self.masked)
        dead = sorted(set(self.sharers) - set(alive))
        return {nid: ([a for a in alive if a == nid or a in self.neighbours[nid]],
                      [d for d in dead if d in self.neighbours[nid]]) for nid in alive}

    def finish(self, replies: Mapping[int, Mapping[int, bytes]]) -> np.ndarray:
        """Unmask replies -> the sum mod m of the alive sites' contributions (uint64 residues)."""
        answered = {nid: r for nid, r in replies.items() if nid in self.masked}
        self._require(set(answered), Stage.UNMASK)
        total = np.zeros(self.config.dim, dtype=np.uint64)
        for vec in self.masked.values():
            total = total + vec
        alive = sorted(self.masked)
        for nid in sorted(self.sharers):
            secret = self._reconstruct(nid, [r[nid] for r in answered.values() if nid in r])
            if nid in self.masked:  # its own seed mask
                total = total - prg_mask(secret, self.config)
                continue
            for other in alive:  # a dropped site: remove the pairwise masks the alive sites added for it
                if nid in self.neighbours[other]:
                    total = total - pairwise_mask(_pair_key(secret, self.keys[other][0]), other, nid, self.config)
        self.contributors = tuple(alive)
        self.masked = {}
        return total & self.config.mask

    def _reconstruct(self, nid: int, shares: list[bytes]) -> bytes:
        if len(shares) < self.config.threshold:
            raise SecAggError(f"round {self.config.round_id}: {len(shares)} share(s) of site {nid}'s secret, below the "
                              f"threshold {self.config.threshold}; the round is refused (nothing is decoded)")
        try:
            return combine_shares(shares[: self.config.threshold])
        except ValueError:
            raise SecAggError(f"round {self.config.round_id}: the shares of site {nid}'s secret do not combine "
                              f"(a corrupted share); the round is refused") from None
