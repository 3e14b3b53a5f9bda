"""The node agent: runs on a GPU node, launches one engine process per replica, supervises it,
scrapes its metrics and reports to the control plane. A plain package: no Django here."""
