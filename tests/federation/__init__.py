"""The coordinator and the federated protocol: the Grid harness, FedSGD, secure aggregation, Flower
processes."""
