from vllmini.cli import main

raise SystemExit(main())
