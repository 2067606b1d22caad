"""Cloud job environments (AzureML, AWS SageMaker, DLTS) and their rank variables.

These services start ranks with MPI and do not set torch's ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR``; the ``patch_*`` functions translate their variables into torch's names.
"""

from __future__ import annotations

import os

from shardspeed.utils.logging import logger


def in_aml() -> bool:
    """Whether this process runs in an AzureML job."""
    return "AZUREML_EXPERIMENT_ID" in os.environ


def in_aws_sm() -> bool:
    """Whether this process runs in an AWS SageMaker training job."""
    return "SM_TRAINING_ENV" in os.environ


def in_dlts() -> bool:
    """Whether this process runs in a DLTS (Deep Learning Training Service) job."""
    return "DLTS_JOB_ID" in os.environ


def _copy_ompi_ranks() -> None:
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    os.environ["LOCAL_RANK"] = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")


def patch_aml_env_for_torch_nccl_backend(master_port: int = 6105, verbose: bool = True) -> None:
    """Set torch's rank variables from AzureML's MPI ones.

    Single-node jobs rendezvous on AzureML's MPI master node; multi-node jobs on the batch master
    node (``AZ_BATCH_MASTER_NODE`` is ``host:port``).
    """
    _copy_ompi_ranks()
    single_node = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") == os.environ["WORLD_SIZE"]
    if not single_node:
        host, _, port = os.environ["AZ_BATCH_MASTER_NODE"].partition(":")
        os.environ["MASTER_ADDR"] = host
        os.environ["MASTER_PORT"] = port or str(master_port)
    else:
        os.environ["MASTER_ADDR"] = os.environ.get("AZ_BATCHAI_MPI_MASTER_NODE", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(master_port)
    if verbose:
        logger.info(
            f"AzureML env: RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} "
            f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']}"
        )


def patch_aws_sm_env_for_torch_nccl_backend(verbose: bool = True) -> None:
    """Set torch's rank variables from SageMaker's OpenMPI ones (MASTER_ADDR is set by SM)."""
    _copy_ompi_ranks()
    if verbose:
        logger.info(
            f"SageMaker env: RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} "
            f"LOCAL_RANK={os.environ['LOCAL_RANK']}"
        )
