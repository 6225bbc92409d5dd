"""Scale-out above whole engines: data-parallel replicas (local processes or Ray actors), routing and failover."""
