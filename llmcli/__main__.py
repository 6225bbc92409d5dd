"""`python -m llmcli`: the same command line as the installed `llmcli`."""
from llmcli.cli.app import main

if __name__ == "__main__":
    main()
