"""Print pip constraints holding transformers, peft and datasets at the lowest release of their tested ranges
(the `recipe` extra of pyproject.toml), for the CI run that tests the old end of each range."""

import re
import tomllib

with open("pyproject.toml", "rb") as file:
    recipe = tomllib.load(file)["project"]["optional-dependencies"]["recipe"]
for requirement in recipe:
    if match := re.fullmatch(r"(transformers|peft|datasets)>=([\w.]+)(,.*)?", requirement):
        print(f"{match[1]}=={match[2]}")
