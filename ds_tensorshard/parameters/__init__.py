"""The parameter side of ZeRO stage 3 with parameters owned whole: who keeps each tensor (``ownership``), the
protocol DeepSpeed's stage-3 hooks call on a parameter (``owned``), the gather of a batch from its owners
(``gather``), and ``zero.Init`` converting parameters with that protocol (``init_hooks``)."""
