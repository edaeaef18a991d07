"""Private next-token generators that Hot PATE is compared with, on the same teachers.

Every peer reads the same inputs as `pate.generation.generate`: an ensemble of n teachers
(`generation.Teachers`: prefix -> `(n, V)` logits, one sensitive unit behind each teacher) and a
public model (`generation.PublicModel`: prefix -> `(V,)` logits). Each module holds one method:
its frozen config, `calibrate` (the config whose worst-case run costs at most a target (ε, δ)
under the method's own analysis), a jitted per-token `step`, the method's privacy analysis, and
`generate`, which decodes one text and returns a `PeerResult`; its `METHOD` runs it as a
`pate.method.Method` (a whole run of texts, calibrated and charged as one).

Modules: `invisibleink` (Vinod et al., NeurIPS 2025), `amin` (Amin et al. 2024, arXiv
2407.12108), `pmixed` (Flemings et al., NAACL 2024), `reference` (the ε = 0 and ε = ∞
references), `decoding` (the token loop they share), `peer_method` (what their `METHOD`s share)
and `result` (`PeerResult`).
"""

from dpmix_jax.pate.peers.result import PeerResult

__all__ = ["PeerResult"]
