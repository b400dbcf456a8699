"""Pre-flight checks of the cluster configs, the image recipe and the upload filters (run: python cluster/check.py).

Each check returns a list of problems (empty: fine); ``run_all`` runs every check on a repository checkout, with the
cluster configs read from the templates (cluster/) or their filled-in copies (cluster/filled/, same layout).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from .common import (CLUSTER_README, CONSTRAINTS, DOCKER_README, DOCKERFILE, FILESTORE_FLAGS, IAM_DIR, KUBERAY,
                     KUBERAY_MLFLOW, KUBERAY_NAMESPACE, LAUNCHERS, SMOKE_SCRIPT, load_docs, load_pins, load_yaml, one)


def _config(configs: Path, rel: str) -> Path:
    """A config of the layout constants (``cluster/aws.yaml``) in the folder being checked."""
    return configs / Path(rel).relative_to("cluster")


def _launcher_section(root: Path, configs: Path, provider: str, image: str) -> list[str]:
    from .launcher import bash_syntax_errors, all_shell_commands, check_launcher, ray_validate
    from .trust_cloud import aws_trust_problems, gcp_trust_problems, vm_mlflow_problems, vm_secret_problems
    from .trust_iam import gcp_head_binding_problems

    cfg = load_yaml(_config(configs, LAUNCHERS[provider]))
    try:
        ray_validate(cfg)
    except Exception as err:  # noqa: BLE001 - Ray's validators raise ValueError, jsonschema errors, KeyError
        # The structure is not what `ray up` accepts: the project's checks would only add noise.
        return [f"Ray's validator: {type(err).__name__}: {str(err).splitlines()[0]}"]
    problems = check_launcher(cfg, provider, image) + bash_syntax_errors(all_shell_commands(cfg))
    problems += vm_secret_problems(cfg) + vm_mlflow_problems(cfg)
    if provider == "aws":
        return problems + aws_trust_problems(cfg, _config(configs, IAM_DIR))
    problems += gcp_trust_problems(cfg, _config(configs, IAM_DIR), load_yaml(_config(configs, FILESTORE_FLAGS)))
    return problems + gcp_head_binding_problems(cfg, _config(configs, IAM_DIR), (root / CLUSTER_README).read_text())


def _kuberay_section(root: Path, configs: Path) -> list[str]:
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
    from ray.autoscaler._private.util import validate_config

    from .kuberay import check_kuberay, mlflow_reachability_problems, shared_volume_problems
    from .trust_kube import (head_token_problems, metadata_egress_problems, mlflow_auth_problems,
                             network_policy_problems, pod_security_problems, ray_token_problems,
                             security_context_problems, service_account_problems, service_exposure_problems)

    ray_docs, mlflow_docs = load_docs(_config(configs, KUBERAY)), load_docs(_config(configs, KUBERAY_MLFLOW))
    cr = one(ray_docs, "RayCluster")
    try:
        validate_config(_derive_autoscaling_config_from_ray_cr(cr))
    except Exception as err:  # noqa: BLE001 - the conversion raises KeyError, ValueError, jsonschema errors
        return [f"KubeRay-to-autoscaler conversion: {type(err).__name__}: {str(err).splitlines()[0]}"]
    problems = check_kuberay(cr, load_pins(root)) + shared_volume_problems(cr, ray_docs)
    problems += mlflow_reachability_problems(cr, mlflow_docs)
    for check in (service_account_problems, head_token_problems, security_context_problems, network_policy_problems,
                  metadata_egress_problems, service_exposure_problems, ray_token_problems, mlflow_auth_problems):
        problems += check(ray_docs, mlflow_docs)
    return problems + pod_security_problems(load_docs(_config(configs, KUBERAY_NAMESPACE)), ray_docs)


def _image_section(root: Path, configs: Path) -> list[str]:
    from .image import check_dockerfile, collect_images, documented_images, image_tag_problems, smoke_command_problems
    from .supply import constraints_problems, sudo_problems

    dockerfile, smoke = (root / DOCKERFILE).read_text(), (root / SMOKE_SCRIPT).read_text()
    texts = {n: (root / n).read_text() for n in (SMOKE_SCRIPT, DOCKER_README, DOCKERFILE, "cluster/README.md")}
    documented = documented_images(root)
    problems = [] if set(documented) == {"gpu", "cpu"} else [
        f"{DOCKER_README} must document one gpu and one cpu tag, got {sorted(documented.values())}"]
    problems += check_dockerfile(dockerfile, load_pins(root)) + smoke_command_problems(texts)
    problems += image_tag_problems(collect_images(root, configs), documented)
    problems += constraints_problems(dockerfile, (root / CONSTRAINTS).read_text(), load_pins(root))
    return problems + sudo_problems(dockerfile, smoke)


def run_all(root: Path, configs: Path | None = None) -> dict[str, list[str]]:
    """Every check on the checkout at ``root`` with the cluster configs of ``configs`` (default: the templates,
    ``root/cluster``): {section: problems}. Placeholders are not problems here (check.py names them)."""
    configs = root / "cluster" if configs is None else configs
    from .image import documented_images
    from .supply import ignore_problems

    gpu = documented_images(root).get("gpu", "")
    sections = {
        LAUNCHERS["aws"]: lambda: _launcher_section(root, configs, "aws", gpu),
        LAUNCHERS["gcp"]: lambda: _launcher_section(root, configs, "gcp", gpu),
        f"{KUBERAY} + {KUBERAY_MLFLOW}": lambda: _kuberay_section(root, configs),  # and KUBERAY_NAMESPACE
        f"{DOCKERFILE} + image references": lambda: _image_section(root, configs),
        ".rayignore + .dockerignore": lambda: ignore_problems((root / ".rayignore").read_text(),
                                                              (root / ".dockerignore").read_text()),
    }
    results = {}
    for name, check in sections.items():
        try:
            results[name] = check()
        except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError, IndexError, ValueError) as err:
            # A missing file, unparsable YAML or a config without an expected key: one line, not a traceback.
            results[name] = [f"cannot check: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"]
    return results
