"""`kvserve plan --emit-config DIR`: a plan turned into what deploys it (serve.yaml, a kustomize overlay for the
GPU class) and the day-2 bench script that checks it. Pure text from the plan's figures, no torch."""
