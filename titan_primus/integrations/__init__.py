"""Where titan-primus meets the training frameworks it plugs into; one subpackage per framework.
Nothing else in titan-primus imports a framework."""
