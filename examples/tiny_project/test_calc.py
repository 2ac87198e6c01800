"""The tiny project's tests (standard-library unittest, so no install is needed)."""

import unittest

import calc


class CalcTest(unittest.TestCase):
    def test_add(self) -> None:
        self.assertEqual(calc.add(2, 3), 5)

    def test_mul(self) -> None:
        self.assertEqual(calc.mul(2, 3), 6)


if __name__ == "__main__":
    unittest.main()
