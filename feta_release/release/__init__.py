"""Release: ONNX generator export, signed manifest, offline verification, torch-free synthesis.

Modules (imported on demand; this package imports nothing itself, so ``verify``/``synthesize`` never pull
torch):

- :mod:`.onnx_export` (needs torch for tracing): ``export_denoiser``, ``build_generator``,
  ``SamplerSettings``.
- :mod:`.manifest`: ``build_attestation`` (a site's signed spend statement; the node ledger reuses it),
  ``site_record``, ``build_manifest``, ``sign_manifest``, ``statement_sha256``.
- :mod:`.export_run`: ``assemble_release`` (called on a job directory by ``jobdir.build_release``).
- :mod:`.verify`: ``verify_release`` -> ``VerificationResult``; ``describe_site`` (words for a DPO).
- :mod:`.synthesize`: ``synthesize`` (onnxruntime + numpy + Pillow only), ``make_session``.
"""
