"""The recipe's config: YAML read into typed dataclasses (`typed_yaml`, `config_loading`), the dataclasses
(`config`) and the rules across keys their types cannot say (`config_checks`)."""
