"""The recipe's config: YAML read into typed dataclasses (`typed_yaml`, `config_loading`), the dataclasses
(`config`) and the rules across keys their types cannot say (`config_checks`, with those of `kd` in `kd_checks`
and of the layout in `layout_checks`)."""
