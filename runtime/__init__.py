"""What runs in serving: problems and buckets, platform detection, kernels, rules, the dispatcher."""
