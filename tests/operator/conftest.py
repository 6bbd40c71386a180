"""The operator's tests, in folders that mirror the package (api, reconcile, chart,
autoscaler). This file's folder holds their shared helpers (``kube_testing``,
``autoscaler_testing``, ``slo_testing``, ``chart_rbac``); pytest puts it on ``sys.path``
because this conftest is here, so a test in any subfolder imports them by name."""
