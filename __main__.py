from hopline.cli.main import main

raise SystemExit(main())
