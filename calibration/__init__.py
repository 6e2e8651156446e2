"""X-Stage calibration: remote-store burst microbenchmarks and the Burst–Gap model fit (paper Section 3).

Modules: ``kernels`` (CuTe DSL burst kernel), ``runner`` (GPU experiments, raw CSV), ``analysis``
(per-burst series and steady state), ``fit`` (R, T_iss0, Q and validation; pure numpy), ``report``
(profile JSON, figures, markdown). CLI: ``python -m calibration run|fit|report|all``. The multi-GPU
suite's NVLink peer calibration: ``lab.calibration.peer``.
"""
