from hopline.cli import main

raise SystemExit(main())
